"""Moving shards between node daemons: the interface (``base``) and its transports (today
``http``: the client and the peer routes it calls)."""

from statestore.transport.base import PeerError, PushCounts, RemoteShard, Transport
from statestore.transport.http import HttpTransport, peer_routes

__all__ = ["HttpTransport", "PeerError", "PushCounts", "RemoteShard", "Transport", "peer_routes"]
