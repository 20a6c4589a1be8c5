"""The socket options of pushes, whichever transport carries them."""

from __future__ import annotations

import socket

TCP_NOTSENT_LOWAT = getattr(socket, "TCP_NOTSENT_LOWAT", 25)  # Linux


def push_socket_options(sock: socket.socket, lowat: int) -> None:
    """A push's socket keeps about ``lowat`` bytes unsent (the gate's chunk), and BBR keeps the
    bottleneck's queue short: TRAIN does not start behind STATE."""
    sock.setsockopt(socket.IPPROTO_TCP, TCP_NOTSENT_LOWAT, lowat)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, b"bbr")
    except OSError:
        pass
