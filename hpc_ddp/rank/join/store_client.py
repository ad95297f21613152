"""A client of the job's store (authstore.py's server, its protocol and handshake), in plain
Python: what a supervisor holds (no torch in its process), and what torch_store.py wraps as
the ``torch.distributed.Store`` the process group takes."""

from __future__ import annotations

import hmac
import os
import socket
import struct
import threading
from datetime import timedelta
from typing import Any

from hpc_ddp.rank.join.authstore import (
    ADD,
    APPEND,
    CAS,
    CHECK,
    DELETE,
    GET,
    MAGIC,
    MGET,
    MSET,
    NONCE,
    NUM,
    REFUSED,
    SET,
    TIMED_OUT,
    WAIT,
    StoreServer,
    mac,
    pack,
    unpack,
)
from hpc_ddp.sockets import recv_exact


class StoreRefused(ConnectionError):
    """What answered at the address is not this attempt's store (no store, another run's,
    or one that does not know this key)."""


class StoreError(RuntimeError):
    """The store refused a request (torch_store.py raises torch's DistStoreError instead)."""


class StoreTimeout(StoreError):
    """A blocking request (get, wait) ran out of time; its message says "timeout"."""


class StoreLost(StoreError, ConnectionError):
    """The connection to the store broke (rank 0's process is gone)."""


def _connect(host: str, port: int, key: bytes, timeout_s: float) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=timeout_s)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hello = recv_exact(sock, len(MAGIC) + NONCE)
        if not hello.startswith(MAGIC):
            raise StoreRefused("something that is not an hpc_ddp store answers there")
        challenge, mine = hello[len(MAGIC):], os.urandom(NONCE)
        sock.sendall(mine + mac(key, b"client", challenge, mine))
        try:
            proof = recv_exact(sock, 32)
        except ConnectionError:
            raise StoreRefused("a store of another run answers there (a stale endpoint)") from None
        if not hmac.compare_digest(proof, mac(key, b"server", mine, challenge)):
            raise StoreRefused("a store that does not know this run's key answers there")
        sock.settimeout(None)
        return sock
    except BaseException:
        sock.close()
        raise


class StoreClient:
    """A client of a :class:`StoreServer` (``server``: the one it keeps alive, on rank 0).
    One request at a time (a lock, as TCPStore's client); a blocking request waits on the
    server for at most the store's timeout, then raises :class:`StoreTimeout`. Its methods
    are torch.distributed.Store's, so the code that uses a store takes either."""

    def __init__(self, host: str, port: int, key: str, timeout: timedelta,
                 connect_timeout_s: float = 10.0, server: StoreServer | None = None) -> None:
        self.host, self.port = host, port
        self._key = key
        self._server = server
        self._timeout = timeout
        self._lock = threading.Lock()
        self._sock = _connect(host, port, bytes.fromhex(key), connect_timeout_s)

    def __repr__(self) -> str:
        return f"StoreClient({self.host}:{self.port})"

    @property
    def timeout(self) -> timedelta:
        return self._timeout

    def _call(self, op: int, fields: list[bytes], timeout: timedelta | None = None) -> list[bytes]:
        wait = (timeout or self._timeout).total_seconds()
        body = bytes([op]) + struct.pack("!Q", int(wait * 1000)) + pack(fields)
        with self._lock:
            try:
                # The server answers a blocking request when it ends; a dead one, never.
                self._sock.settimeout(wait + 30)
                self._sock.sendall(struct.pack("!I", len(body)) + body)
                (size,) = struct.unpack("!I", recv_exact(self._sock, 4))
                reply = recv_exact(self._sock, size)
            except OSError as exc:
                raise StoreLost(
                    f"Connection to the store at {self.host}:{self.port} lost: {exc}") from None
        if reply[0] == TIMED_OUT:
            names = ", ".join(f.decode(errors="replace") for f in fields[:4])
            raise StoreTimeout(f"wait timeout after {int(wait * 1000)}ms, keys: {names}")
        if reply[0] == REFUSED:
            raise StoreError(f"the store refused the request: "
                             f"{unpack(reply, 1)[0].decode(errors='replace')}")
        return unpack(reply, 1)

    def clone(self) -> StoreClient:
        """A second connection (a thread of its own: one request at a time per connection)."""
        return StoreClient(self.host, self.port, self._key, self._timeout, server=self._server)

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout

    def set(self, key: str, value: bytes | str) -> None:
        self._call(SET, [_b(key), _b(value)])

    def get(self, key: str) -> bytes:
        return self._call(GET, [_b(key)])[0]

    def add(self, key: str, value: int) -> int:
        return int(self._call(ADD, [_b(key), str(int(value)).encode()])[0])

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        return self._call(CAS, [_b(key), _b(expected), _b(desired)])[0]

    def check(self, keys: list[str]) -> bool:
        return self._call(CHECK, [_b(k) for k in keys])[0] == b"1"

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._call(WAIT, [_b(k) for k in keys], timeout)

    def delete_key(self, key: str) -> bool:
        return self._call(DELETE, [_b(key)])[0] == b"1"

    def num_keys(self) -> int:
        return int(self._call(NUM, [])[0])

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._call(MGET, [_b(k) for k in keys])

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        self._call(MSET, [_b(k) for k in keys] + [_b(v) for v in values])

    def append(self, key: str, value: bytes | str) -> None:
        self._call(APPEND, [_b(key), _b(value)])


class PrefixedStore:
    """``store``'s keys under ``prefix``, as torch's PrefixStore keeps them
    (``prefix/key``: rendezvous.prefixed), for a process that has no torch."""

    def __init__(self, prefix: str, store: Any) -> None:
        self.prefix, self.store = prefix, store

    def _k(self, key: str) -> str:
        return f"{self.prefix}/{key}"

    def set(self, key: str, value: bytes | str) -> None:
        self.store.set(self._k(key), value)

    def get(self, key: str) -> bytes:
        return bytes(self.store.get(self._k(key)))

    def add(self, key: str, value: int) -> int:
        return int(self.store.add(self._k(key), value))

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        return bytes(self.store.compare_set(self._k(key), expected, desired))

    def check(self, keys: list[str]) -> bool:
        return bool(self.store.check([self._k(k) for k in keys]))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self.store.wait([self._k(k) for k in keys])
        else:
            self.store.wait([self._k(k) for k in keys], timeout)

    def delete_key(self, key: str) -> bool:
        return bool(self.store.delete_key(self._k(key)))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [bytes(v) for v in self.store.multi_get([self._k(k) for k in keys])]

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        self.store.multi_set([self._k(k) for k in keys], values)

    def append(self, key: str, value: bytes | str) -> None:
        self.store.append(self._k(key), value)


def _b(value: bytes | str | Any) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)
