"""The plumbing both ffplane servers and the client library run on, none of it a wire format:
uvicorn serving with ffplane's limits and signals (``httpserver``), the etcd client
(``etcd``) and populating a mapping's page tables ahead of use (``pagemap``).

It imports only ``ffplane_contract`` (``tests/test_layout.py``).
"""
