"""ffplane on this machine in one command: a data server, a node daemon, a short training loop.

    python examples/quickstart.py

Generates a small tokenised dataset, ingests it, starts the data server and a node daemon as
real processes, trains a tiny next-token model for a few dozen steps reading every batch through
the daemon's shared-memory cache and checkpointing after every step into the daemon's state slots,
restores the last checkpoint as a restarted worker would, and cleans everything up.
"""

from __future__ import annotations

import json
import secrets
import tempfile
import urllib.request
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from dataserver.ingest import IngestConfig, ingest
from ffplane_harness.local_cluster import LocalCluster
from trainer_client import Checkpointer, DataLoader

VOCAB, SEQ, ROWS, STEPS = 512, 64, 4096, 40


def _post(url: str, body: dict[str, object], token: str) -> None:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json", "Authorization": f"Bearer {token}"})
    urllib.request.urlopen(req).read()


def main() -> None:
    token = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="ffplane-quickstart-") as tmp:
        work = Path(tmp)
        rng = np.random.default_rng(0)
        # a learnable toy language: each token is the previous one plus 1 or 2 (mod VOCAB)
        start = rng.integers(0, VOCAB, size=(ROWS, 1))
        tokens = (start + np.cumsum(rng.integers(1, 3, size=(ROWS, SEQ)), axis=1)) % VOCAB
        pq.write_table(pa.table({"tokens": pa.array(list(tokens.astype(np.int32)))}), work / "toy.parquet")
        ingest(IngestConfig([work / "toy.parquet"], work / "datasets" / "toy", progress=False))

        with LocalCluster(work, work / "datasets", token) as cluster:
            ds = cluster.start_dataserver()
            daemon = cluster.start_daemon(budget_mb=256)
            print(f"data server {ds.url}  node daemon {daemon.url}  socket {cluster.socket()}")
            _post(ds.url + "/v1/jobs", {"name": "quickstart", "dataset": "toy", "dp": 1, "batch_per_rank": 32, "max_steps": STEPS}, token)

            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 64), torch.nn.Linear(64, VOCAB))
            opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
            loader = DataLoader("quickstart", 0, dataserver=ds.url, token=token, socket_path=cluster.socket())
            ckpt = Checkpointer("quickstart", socket_path=cluster.socket())
            for step, batch in enumerate(loader):
                x = batch["tokens"].long()
                loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
                opt.zero_grad()
                loss.backward()
                opt.step()
                ckpt.save(step, {"model": model.state_dict(), "optim": opt.state_dict(), "loader": loader.state_dict()})
                if step % 10 == 0 or step == STEPS - 1:
                    print(f"step {step:3d}  loss {loss.item():.3f}  (batch from {loader.source})")
            loader.close()
            ckpt.close()
            restored = Checkpointer("quickstart", socket_path=cluster.socket()).restore()  # as a restarted worker
            assert restored is not None
            same = all(torch.equal(a, b) for a, b in zip(restored.state["model"].values(), model.state_dict().values()))
            print(
                f"restored step {restored.step} from {restored.source}: weights identical: {same}; "
                f"next batch would be step {restored.state['loader']['next_step']} "
                f"(save blocked {ckpt.last_save_block_s * 1e3:.2f} ms)"
            )
            cache = json.loads(urllib.request.urlopen(daemon.url + "/v1/cache").read())
            s = cache["streams"][0]
            print(f"daemon cache: steps {s['steps']} hits {s['hits']} misses {s['misses']} fetched {s['fetched']}")
    print("done; all processes stopped and shared memory removed")


if __name__ == "__main__":
    main()
