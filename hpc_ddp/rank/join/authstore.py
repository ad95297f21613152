"""The job's store (rendezvous, process group, stop agreement), answering only its own ranks.

torch's TCPStore answers whoever reaches its port: it has no authentication, and any client
can list every key (``list_keys``, torch 2.14) and then read, overwrite or delete them: fail
the rendezvous on every attempt, forge a failure report, or feed the process group other
peers. So the store the ranks share is this one: a server in a thread of rank 0's process
(asyncio: one coroutine per connection, a blocked wait costs no thread and no polling) and a
client that is a ``torch.distributed.Store``, so the process group, PrefixStore and every
user of the store take it as they take a TCPStore.

The client (store_client.py) is plain Python too, so a supervisor, which makes no process
group, holds the store without importing torch; torch_store.py wraps it as the
``torch.distributed.Store`` the process group takes.

A connection is served only after both sides proved they know this attempt's key (HMAC-SHA256
over fresh random challenges from each side: the key never crosses the network, a recorded
exchange cannot be replayed, and a client learns that the store is this attempt's, not a
stale endpoint's). The key is 32 random bytes rank 0 makes for the attempt; it reaches the
other ranks through the endpoint file (mode 600, in the user's run dir) and a supervisor's
child through its environment; it is never logged, never on a command line
(rendezvous.py, docs/security.md). A peer that does not answer the challenge is dropped
after a few seconds, unserved.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import ipaddress
import logging
import os
import resource
import secrets
import socket
import struct
import threading

log = logging.getLogger(__name__)

MAGIC = b"hpc_ddp-store-1\n"
NONCE = 32
_HANDSHAKE_S = 5.0
_MAX_FRAME = 64 << 20  # a request larger than any key or value of ours: a broken peer
ANSWERED, TIMED_OUT, REFUSED = 0, 1, 2
(SET, GET, ADD, CAS, CHECK, WAIT, DELETE, NUM, MGET, MSET, APPEND) = range(11)


def new_key() -> str:
    """A fresh key for an attempt's store (hex)."""
    return secrets.token_hex(32)


def mac(key: bytes, who: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, who + b"".join(parts), hashlib.sha256).digest()


def pack(fields: list[bytes]) -> bytes:
    return struct.pack("!I", len(fields)) + b"".join(
        struct.pack("!I", len(f)) + f for f in fields)


def unpack(data: bytes, at: int = 0) -> list[bytes]:
    (count,), at = struct.unpack_from("!I", data, at), at + 4
    fields = []
    for _ in range(count):
        (size,), at = struct.unpack_from("!I", data, at), at + 4
        fields.append(data[at:at + size])
        at += size
    return fields


# -- the server ---------------------------------------------------------------------------


class StoreServer:
    """This attempt's store, served from a daemon thread of rank 0's process until it ends.
    ``hosts``: the addresses to listen on (empty: every interface)."""

    def __init__(self, key: str, hosts: list[str], port: int = 0) -> None:
        self._key = bytes.fromhex(key)
        self._data: dict[bytes, bytes] = {}
        self._waiters: dict[bytes, set[asyncio.Event]] = {}
        _allow_many_connections()
        self._sockets = _listen(hosts, port)
        self.port = int(self._sockets[0].getsockname()[1])
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True,
                                        name="hpc_ddp-store")
        self._thread.start()
        ready.wait()

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        for sock in self._sockets:
            self._loop.run_until_complete(asyncio.start_server(self._serve, sock=sock))
        ready.set()
        self._loop.run_forever()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            if not await asyncio.wait_for(self._handshake(reader, writer), _HANDSHAKE_S):
                return
            while True:
                (size,) = struct.unpack("!I", await reader.readexactly(4))
                if size > _MAX_FRAME:
                    return
                body = await reader.readexactly(size)
                try:
                    reply = await self._handle(body)
                except (ValueError, IndexError, struct.error) as exc:  # e.g. add to a text
                    reply = bytes([REFUSED]) + pack([str(exc).encode()])
                writer.write(struct.pack("!I", len(reply)) + reply)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError, OSError,
                struct.error, ValueError):
            return  # a peer that left, or never proved it knows the key: dropped
        finally:
            writer.close()

    async def _handshake(self, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> bool:
        challenge = os.urandom(NONCE)
        writer.write(MAGIC + challenge)
        await writer.drain()
        answer = await reader.readexactly(NONCE + 32)
        theirs, proof = answer[:NONCE], answer[NONCE:]
        if not hmac.compare_digest(proof, mac(self._key, b"client", challenge, theirs)):
            return False
        writer.write(mac(self._key, b"server", theirs, challenge))
        await writer.drain()
        return True

    def _set(self, key: bytes, value: bytes) -> None:
        self._data[key] = value
        for event in self._waiters.get(key, ()):
            event.set()

    async def _present(self, keys: list[bytes], timeout_s: float) -> bool:
        """Whether every key is there within ``timeout_s`` (woken by the sets, no polling)."""
        deadline = self._loop.time() + timeout_s
        while True:
            missing = [k for k in keys if k not in self._data]
            if not missing:
                return True
            remaining = deadline - self._loop.time()
            if remaining <= 0:
                return False
            event = asyncio.Event()
            for k in missing:
                self._waiters.setdefault(k, set()).add(event)
            try:
                await asyncio.wait_for(event.wait(), remaining)
            except TimeoutError:
                return False
            finally:
                for k in missing:
                    waiting = self._waiters.get(k)
                    if waiting is not None:
                        waiting.discard(event)
                        if not waiting:
                            del self._waiters[k]

    async def _handle(self, body: bytes) -> bytes:
        op, timeout_ms = body[0], struct.unpack_from("!Q", body, 1)[0]
        f = unpack(body, 9)
        data = self._data
        out: list[bytes] = []
        if op in (GET, WAIT, MGET):
            keys = f if op != GET else f[:1]
            if not await self._present(keys, timeout_ms / 1000):
                return bytes([TIMED_OUT]) + pack([])
            out = [data[k] for k in keys] if op != WAIT else []
        elif op == SET:
            self._set(f[0], f[1])
        elif op == MSET:
            half = len(f) // 2
            for k, v in zip(f[:half], f[half:], strict=True):
                self._set(k, v)
        elif op == ADD:
            total = int(data.get(f[0], b"0")) + int(f[1])
            self._set(f[0], str(total).encode())
            out = [str(total).encode()]
        elif op == APPEND:
            self._set(f[0], data.get(f[0], b"") + f[1])
        elif op == CAS:  # TCPStore's: set when absent and expected is empty, or when equal
            current = data.get(f[0])
            if (current is None and not f[1]) or current == f[1]:
                self._set(f[0], f[2])
                current = f[2]
            out = [f[1] if current is None else current]
        elif op == CHECK:
            out = [b"1" if all(k in data for k in f) else b"0"]
        elif op == DELETE:
            out = [b"1" if data.pop(f[0], None) is not None else b"0"]
        elif op == NUM:
            out = [str(len(data)).encode()]
        else:
            raise ValueError(f"unknown request {op}")
        return bytes([ANSWERED]) + pack(out)


def _allow_many_connections() -> None:
    """Every rank holds a connection or three: the soft limit of open files (often 1024)
    raised to the hard one, as far as it goes."""
    with contextlib.suppress(ValueError, OSError):
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _listen(hosts: list[str], port: int) -> list[socket.socket]:
    """Listening sockets on ``hosts`` (IP addresses; none: every interface), the same port
    (a free one for port 0: tried again where the first one's is taken on another address)."""
    for _ in range(5 if port == 0 and len(hosts) > 1 else 1):
        try:
            return _bind(hosts, port)
        except OSError as exc:
            error = exc
    raise error


def _bind(hosts: list[str], port: int) -> list[socket.socket]:
    if not hosts:
        try:
            return _bind(["::"], port)  # with IPV6_V6ONLY off: IPv4 as well
        except OSError:  # no IPv6 on this machine
            return _bind(["0.0.0.0"], port)
    made: list[socket.socket] = []
    try:
        for host in hosts:
            family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            made.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if host == "::":  # every interface, IPv4 too
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            sock.bind((host, port))
            port = sock.getsockname()[1]  # the others take the first one's
            sock.listen(4096)
            sock.setblocking(False)
        return made
    except BaseException:
        for sock in made:
            sock.close()
        raise
