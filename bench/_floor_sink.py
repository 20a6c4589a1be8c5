"""The receiving end of ``bench/step_cost.py``'s ``floor`` variant: what a node daemon's replica
receive costs at least. It takes one connection and, for each frame (an 8-byte length, then the
bytes), receives into one reused buffer, hashes it with XXH3 and answers the 8-byte digest.

    python bench/_floor_sink.py PORT_FILE      # writes the port it listens on, then serves
"""

from __future__ import annotations

import socket
import struct
import sys
from pathlib import Path

import xxhash

_LEN = struct.Struct("<Q")


def _recv_into(conn: socket.socket, view: memoryview) -> bool:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            return False
        got += n
    return True


def main(port_file: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        tmp = port_file.with_suffix(".tmp")
        tmp.write_text(str(server.getsockname()[1]))
        tmp.rename(port_file)
        conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(0)
    head = bytearray(_LEN.size)
    with conn:
        while _recv_into(conn, memoryview(head)):
            (n,) = _LEN.unpack(head)
            if len(buf) < n:
                buf = bytearray(n)
            view = memoryview(buf)[:n]
            if not _recv_into(conn, view):
                return
            conn.sendall(_LEN.pack(xxhash.xxh3_64_intdigest(view)))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
