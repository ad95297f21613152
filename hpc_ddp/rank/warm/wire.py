"""What a node's warm process and its clients say to each other over its Unix socket.

A message is a 4-byte length, then that many bytes of JSON; a request may carry open file
descriptors with its length (SCM_RIGHTS: the client's stdin, stdout and stderr, which the
forked process makes its own). Both ends check who is at the other end (SO_PEERCRED): only
this user's processes may ask for a fork, and a client talks only to a warm process of its
own user (https://man7.org/linux/man-pages/man7/unix.7.html).
"""

from __future__ import annotations

import json
import os
import socket
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hpc_ddp.sockets import recv_exact

_LENGTH = struct.Struct("!I")
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
# stdin, stdout, stderr.
MAX_FDS = 3
# A request holds an environment (a supervised child's holds the run's config): far below.
_MAX_MESSAGE = 64 << 20


class WireError(OSError):
    """The other end went away, or sent what is not a message."""


def peer_uid(sock: socket.socket) -> int:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size)
    return int(_CRED.unpack(raw)[1])


def same_user(sock: socket.socket) -> bool:
    return peer_uid(sock) == os.geteuid()


def connect(path: Path) -> socket.socket:
    """A connection to the warm process at ``path``, once it is known to be this user's."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
        if not same_user(sock):
            raise WireError(f"{path} is served by another user")
    except OSError:
        sock.close()
        raise
    return sock


def send(sock: socket.socket, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
    body = json.dumps(message).encode()
    head = _LENGTH.pack(len(body))
    if fds:
        socket.send_fds(sock, [head], list(fds))
    else:
        sock.sendall(head)
    sock.sendall(body)


def receive(sock: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    """The next message and the descriptors sent with it; (None, []) at the end."""
    head, fds, _flags, _addr = socket.recv_fds(sock, _LENGTH.size, MAX_FDS)
    if not head:
        _close(fds)
        return None, []
    try:
        head += _exactly(sock, _LENGTH.size - len(head))
        (length,) = _LENGTH.unpack(head)
        if length > _MAX_MESSAGE:
            raise WireError(f"a message of {length} bytes")
        message = json.loads(_exactly(sock, length))
    except (WireError, ValueError, OSError) as exc:
        _close(fds)
        raise WireError(str(exc)) from None
    if not isinstance(message, dict):
        _close(fds)
        raise WireError("a message that is not an object")
    return message, fds


def _exactly(sock: socket.socket, count: int) -> bytes:
    try:
        return recv_exact(sock, count)
    except ConnectionResetError:
        raise WireError("the other end closed mid-message") from None


def _close(fds: Sequence[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
