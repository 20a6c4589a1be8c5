"""The client library's exceptions: one base, then what went wrong."""

from __future__ import annotations


class FFPlaneError(Exception):
    """Base of every error trainer_client raises."""


class TransportError(FFPlaneError):
    """The daemon or data server could not be reached or broke the protocol."""


class FFTimeoutError(FFPlaneError, TimeoutError):
    """A blocking call ran out of time."""


class NotFoundError(FFPlaneError):
    """The job, step or dataset does not exist (HTTP 404/416)."""


class CorruptError(FFPlaneError):
    """Bytes failed a checksum or do not parse."""


class UnauthorisedError(FFPlaneError):
    """The bearer token is missing or wrong (HTTP 401)."""


class CapacityError(FFPlaneError):
    """The daemon's memory budget (or the tmpfs) cannot hold what was asked (HTTP-like 507)."""


def for_status(status: int, message: str) -> FFPlaneError:
    """The exception matching an HTTP-like status (kept as ``.status``)."""
    err: FFPlaneError
    if status == 401:
        err = UnauthorisedError(f"{message} (set FFPLANE_TOKEN to the job's token)")
    elif status in (404, 416):
        err = NotFoundError(message)
    elif status == 507:
        err = CapacityError(message)
    elif status == 504:
        err = FFTimeoutError(message)
    elif 400 <= status < 500:
        err = FFPlaneError(message)
    else:
        err = TransportError(message)
    err.status = status  # type: ignore[attr-defined]
    return err
