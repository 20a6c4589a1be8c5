"""The limits every ffplane process applies to what comes from outside, defined once: the data
server, the node daemon and the client library import them from here, and each checks at the
first boundary a value crosses (the client at ``save``, the daemon at its control socket and peer
ports, the data server at its routes), so a value one process takes is one every other takes.

A step above the data server's range once got past the client and the daemon and then had every
heartbeat of that node refused: the node was evicted for one job's bad value.
"""

from __future__ import annotations

import re

# Steps are below this: exact in every JSON reader (a browser's, the status page's), so the
# coordinator, the daemons and the page agree on every step they show.
STEP_LIMIT = 1 << 53
MAX_STEP = STEP_LIMIT - 1
# Steps one batch request may ask for: the schema's bound; --max-steps-per-request is at most this.
MAX_COUNT = 1 << 16
# A data server's default --max-steps-per-request, and so the most a daemon's --fetch-steps asks
# for in one request (more would be refused by a server left at its default).
DEFAULT_STEPS_PER_REQUEST = 256
# The largest JSON answer a daemon reads from a data server (a job view, a ring view, a job's
# status): ~100 bytes per node or generation, so 8 MiB holds tens of thousands of either.
MAX_ANSWER_BYTES = 8 << 20
# A byte size or offset of a shard, from a peer: what a signed 64-bit file offset can address.
MAX_BYTES = (1 << 63) - 1
# Job, role and dataset names: no path separators, no leading dot, and short enough to be a file
# name everywhere (a 256-character name made the file system answer ENAMETOOLONG).
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"
NAME_LEN = 128  # the longest name NAME_PATTERN admits, stated apart for schemas (maxLength)
# A node's id: a name that may also hold ':' (host:port ids), as long.
NODE_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$"
# A job's layout: dp and batch_per_rank are at most this (their product is bounded by the data
# server's config), and so is a dp rank.
LAYOUT_LIMIT = 1 << 20
SEED_LIMIT = 1 << 64  # a seed is any unsigned 64-bit integer
_NAME = re.compile(NAME_PATTERN)


def check_step(value: object) -> int:
    """``value`` as a step, or ValueError naming the range."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"a step is an integer, got {type(value).__name__} {value!r}")
    if not 0 <= value <= MAX_STEP:
        raise ValueError(f"step must be in 0..2^53-1, got {value}")
    return value


def is_name(value: object) -> bool:
    """Whether ``value`` is a job, role or dataset name."""
    return isinstance(value, str) and _NAME.match(value) is not None


def check_name(value: object) -> str:
    """``value`` as a job, role or dataset name, or ValueError naming the rule."""
    name = str(value)
    if not is_name(name):
        raise ValueError(f"invalid name {name!r}: names must match {NAME_PATTERN}")
    return name
