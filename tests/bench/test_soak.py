"""The chaos soak (bench/soak.py): every failure kind injected into a torchrun job of the example
GPT script — each recovered, at most one lost step each, every batch the failure-free run's,
final weights bitwise-equal. CI runs a short soak (one of each kind); ``-m slow`` the full one."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import soak


def _check(result: dict[str, object], failures: int) -> None:
    assert result["failures"] == failures and result["unrecoverable"] == 0, result["records"]
    assert result["lost_steps"]["max"] <= 1, result["records"]  # type: ignore[index]
    assert result["data_exactly_once"] is True, result["data_detail"]
    assert result["bitwise_equal"] is True


@pytest.mark.bench  # a soak at its smallest: .ci/run's benchmark step
def test_a_short_soak_survives_every_failure_kind(tmp_path: Path) -> None:
    result = soak.main(["--failures", str(len(soak.KINDS)), "--results-dir", str(tmp_path)])
    _check(result, len(soak.KINDS))
    assert set(result["by_kind"]) == set(soak.KINDS)
    assert (tmp_path / "soak.json").exists()


@pytest.mark.slow
@pytest.mark.timeout(3600)  # ~25 min here; the suite's 300 s limit cut it short
def test_the_full_soak_survives_200_failures(tmp_path: Path) -> None:
    _check(soak.main(["--failures", "200", "--results-dir", str(tmp_path)]), 200)


@pytest.mark.slow
@pytest.mark.timeout(4 * 3600)  # ~2 h here
def test_the_1000_failure_soak_of_every_kind(tmp_path: Path) -> None:
    args = ["--failures", "1000", "--kinds", "all", "--data-servers", "2", "--rendezvous", "ffplane", "--durable-every", "4"]
    result = soak.main([*args, "--results-dir", str(tmp_path), "--out", "soak_1000"])
    _check(result, 1000)
    fallback = result["durable_fallback"]
    assert fallback["warned"] and fallback["max_lost"] <= soak.durable_bound(4), fallback  # type: ignore[index]
