"""The errors every ffplane process raises to another, and the one table of their HTTP statuses.

Servers raise these; the control socket's error replies carry the class's name (``kind``)
beside its status, so the client raises the very type the daemon did and branches on types,
never on numbers. An answer without a kind (an HTTP proxy's, an older daemon's) falls back to
the status alone (``error_from``).
"""

from __future__ import annotations


class FFPlaneError(Exception):
    """Base of every ffplane error; ``status`` is the HTTP (or HTTP-like) status it answers as."""

    status = 400

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        if status is not None:
            self.status = status


class UnauthorisedError(FFPlaneError):
    """The bearer token is missing or wrong. Every process of a job needs the same token: set
    FFPLANE_TOKEN (or FFPLANE_TOKEN_FILE) to it."""

    status = 401


class NotFoundError(FFPlaneError):
    """The job, step, shard or dataset does not exist (404),
    or a step lies past the job's end (416)."""

    status = 404


class ConflictError(FFPlaneError):
    """The request does not fit the state the server is in now; the message says which state.

    The subclasses below are the conflicts a client acts on."""

    status = 409


class SlotBusyError(ConflictError):
    """No slot of the role is free now: a save still commits, or a copy to the durable tier
    holds one. Retry in a moment."""


class UnknownSlotError(ConflictError):
    """A commit or abort names a slot this daemon did not hand out (it restarted without it, on a
    wiped tmpfs or another node): allocate again."""


class TransferOrderError(ConflictError):
    """A replica transfer's request is out of order: no transfer begun, or a gap in the body.
    Resume from the offset the message names, or begin again."""


class NoSlotsError(FFPlaneError):
    """The daemon holds no slots for the role (a new node, a wiped tmpfs):
    send ``Alloc`` first."""

    status = 412


class StaticHeaderUnknownError(FFPlaneError):
    """The daemon lacks the header's static part the commit names (it restarted):
    send the commit again with ``static_header``."""

    status = 428


class CorruptError(FFPlaneError):
    """Bytes failed a checksum or do not parse; the copy is dropped and never offered again,
    so asking again finds another copy or an older step."""

    status = 422


class InvalidError(FFPlaneError, ValueError):
    """A value breaks its rule or its bound (a name, a layout, an address, a field of a record or
    a body, a body not sent as JSON); the message names the value and the rule.

    A ValueError too, as a bad value is in Python."""

    status = 422


class NotCoordinatorError(FFPlaneError):
    """This data server does not coordinate now: send the request to the one that does (over
    HTTP, the X-FFplane-Leader header names it; empty while none does).

    ``leader``: that server's URL, None while none coordinates."""

    status = 421

    def __init__(self, message: str, status: int | None = None, *, leader: str | None = None) -> None:
        super().__init__(message, status)
        self.leader = leader


class CapacityError(FFPlaneError):
    """The memory budget (or the tmpfs) cannot hold what was asked:
    raise the daemon's --budget-mb and the tmpfs size, or ask for less.
    Over HTTP, a request for more than a server answers at once is 413."""

    status = 507


class TransportError(FFPlaneError):
    """A daemon, peer or data server could not be reached, or broke the protocol.
    Check that it runs and that this host reaches its address."""

    status = 502


class UnavailableError(TransportError):
    """A server this request needs did not answer now (a dying node, a busy data server);
    the coordinator notices a dead node within seconds. Retry."""

    status = 503


class FFTimeoutError(FFPlaneError, TimeoutError):
    """A blocking call ran out of time (not a TransportError: the connection may still be fine)."""

    status = 504


_KINDS: dict[str, type[FFPlaneError]] = {
    cls.__name__: cls
    for cls in (
        FFPlaneError,
        UnauthorisedError,
        NotFoundError,
        ConflictError,
        SlotBusyError,
        UnknownSlotError,
        TransferOrderError,
        NoSlotsError,
        StaticHeaderUnknownError,
        CorruptError,
        InvalidError,
        NotCoordinatorError,
        CapacityError,
        TransportError,
        UnavailableError,
        FFTimeoutError,
    )
}
# An answer that names no kind: by its status. Other 4xx are the base class, other 5xx transport.
_BY_STATUS: dict[int, type[FFPlaneError]] = {
    401: UnauthorisedError,
    404: NotFoundError,
    416: NotFoundError,
    503: UnavailableError,
    504: FFTimeoutError,
    507: CapacityError,
}


def kind_of(exc: FFPlaneError) -> str:
    """The name an error travels under: its class's, or the nearest shared base's."""
    for cls in type(exc).__mro__:
        if cls.__name__ in _KINDS and _KINDS[cls.__name__] is cls:
            return cls.__name__
    return FFPlaneError.__name__


def error_from(status: int, message: str, kind: str | None = None) -> FFPlaneError:
    """The error an answer of ``status`` (and ``kind``, when it names one) stands for."""
    cls = _KINDS.get(kind or "") or _BY_STATUS.get(status) or (FFPlaneError if 400 <= status < 500 else TransportError)
    if cls is UnauthorisedError:
        message = f"{message} (set FFPLANE_TOKEN to the job's token)"
    return cls(message, status)
