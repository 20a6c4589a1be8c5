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


def for_status(status: int, message: str) -> FFPlaneError:
    """The exception matching an HTTP-like status."""
    if status == 401:
        return UnauthorisedError(f"{message} (set FFPLANE_TOKEN to the job's token)")
    if status in (404, 416):
        return NotFoundError(message)
    if status == 504:
        return FFTimeoutError(message)
    if 400 <= status < 500:
        return FFPlaneError(message)
    return TransportError(message)
