"""Every benchmark runs at a tiny size, so none of them rots between measurement runs."""

from __future__ import annotations

import json
from pathlib import Path

from bench import data_path


def test_data_path_smoke(tmp_path: Path) -> None:
    out = data_path.main([
        "--gib", "0.02", "--batch", "32", "--seq", "256", "--steps", "6", "--cached-steps", "4",
        "--repeats", "1", "--no-mosaic", "--work", str(tmp_path / "work"), "--results-dir", str(tmp_path), "--out", "dp",
    ])
    saved = json.loads((tmp_path / "dp.json").read_text())
    for name in ("memcpy_gbps", "loopback_tcp_gbps", "node_cache_read_gbps", "end_to_end_gbps", "torch_dataloader_local_gbps"):
        assert saved["figures"][name]["median"] > 0, name
    assert set(out["targets"]) >= {"node_cache_read_vs_memcpy", "end_to_end_vs_loopback_tcp"}
