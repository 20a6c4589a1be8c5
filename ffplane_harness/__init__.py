"""The cluster harness: ``ffplane demo``, local and network-namespace clusters, one torchrun per
node, the job runner. Tests, benchmarks and the demo use it; training code never imports it."""
