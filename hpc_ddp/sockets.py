"""Reading a stream socket to a message's end: the rendezvous store's client
(rank/join/store_client.py) and a node's warm process (rank/warm/wire.py) both frame their
messages by length."""

from __future__ import annotations

import socket


def recv_exact(sock: socket.socket, size: int) -> bytes:
    """``size`` bytes from ``sock`` (ConnectionResetError when it closes first)."""
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionResetError("the other end closed the connection")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
