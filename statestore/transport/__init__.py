"""Moving shards between node daemons: the interface (``base``) and its transports: ``http`` (the
client of the peer routes, ``statestore.routes.peer``) and ``bulk`` (replica pushes on a port of their own, over
``sendfile`` into the receiver's mapping; everything else over ``http``)."""

from statestore.transport.base import PeerError, PushCounts, RemoteShard, Transport
from statestore.transport.bulk import BulkServer, BulkTransport
from statestore.transport.http import HttpTransport, read_meta_prefix

__all__ = ["BulkServer", "BulkTransport", "HttpTransport", "PeerError", "PushCounts", "RemoteShard", "Transport", "read_meta_prefix"]
