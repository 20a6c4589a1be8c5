"""What a job that torchrun restarts needs from its environment.

torchrun 2.13 shares the rendezvous TCPStore with the workers across restarts by default, so a
restarted process group reads the previous generation's gloo addresses — "Connection refused"
or a hang in about half of the worker restarts — and a node that joins later waits for a
``MASTER_ADDR`` the old rank 0 never republishes. ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
gives every round a fresh store (docs/decisions.md); :func:`check_restartable` warns when a
restartable job runs without it.
"""

from __future__ import annotations

import os
import warnings

FRESH_STORE_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def check_restartable() -> None:
    """Warn (once per process) when torchrun will restart this worker into a shared, stale store."""
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    if restarts > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        warnings.warn(
            "torchrun runs this job with --max-restarts but shares its rendezvous store with the workers: "
            "restarted workers may read a dead peer's address (gloo 'Connection refused' or a hang). "
            "Launch torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment.",
            RuntimeWarning,
            stacklevel=2,
        )
