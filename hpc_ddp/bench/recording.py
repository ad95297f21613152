"""What one rank costs, counted: a recording store, a recording file layer, a simulated clock.

The flat-cost tests (tests/unit/test_scale_cost.py) and ``python -m hpc_ddp.bench scale`` run
hpc_ddp's own code for one rank of a simulated world (scale_world.py) inside these and read
the counts: store operations and bytes, file operations, bytes and directory entries read,
Slurm commands run.

- :class:`RecordingStore` is an in-memory c10d store with the operations hpc_ddp uses (set,
  get, add, check, wait, append, multi_get, multi_set, compare_set, delete_key,
  set_timeout), so it can stand wherever a TCPStore does; :meth:`RecordingStore.seed` and
  ``seed_prefix`` put in what the other ranks of the world would have written.
  ``dead=True``: every operation fails, as when the store died with rank 0's process.
- :class:`FileRecorder` counts what the code does under one folder (the run dir): opens,
  reads and writes with their bytes, stats, listings with their entries, renames, removals,
  fsyncs, by patching ``open``/``os`` for the duration (other paths are not counted).
- :class:`SimulatedTime` turns ``time.sleep`` into an advance of ``time.monotonic``, so a
  loop that polls until a deadline runs its polls at once, deterministically.
"""

from __future__ import annotations

import builtins
import collections
import io
import os
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any


class StoreGone(RuntimeError):
    """What a RecordingStore(dead=True) raises (a TCPStore whose server is gone raises too)."""


def _b(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


class RecordingStore:
    """An in-memory store that counts every call and the bytes it moves (see module doc)."""

    def __init__(self, dead: bool = False) -> None:
        self.data: dict[str, bytes] = {}
        self.dead = dead
        self.calls: collections.Counter[str] = collections.Counter()
        self.sent = 0  # key and value bytes sent to the store
        self.received = 0  # value bytes received from it
        self._prefixes: list[tuple[str, bytes]] = []

    # -- what the simulated world put there ------------------------------------------------
    def seed(self, key: str, value: Any) -> None:
        self.data[key] = _b(value)

    def seed_prefix(self, prefix: str, value: Any) -> None:
        """A key under ``prefix`` that nobody set yet reads as ``value`` (the other ranks'
        additions to a counter whose exact name is made at run time)."""
        self._prefixes.append((prefix, _b(value)))

    # -- counting ----------------------------------------------------------------------------
    @property
    def ops(self) -> int:
        return sum(self.calls.values())

    def _op(self, name: str, *sent: Any) -> None:
        self.calls[name] += 1
        if self.dead:
            raise StoreGone(f"store {name}: connection refused (the store's process is gone)")
        self.sent += sum(len(_b(s)) for s in sent)

    def _value(self, key: str) -> bytes | None:
        if key in self.data:
            return self.data[key]
        for prefix, value in self._prefixes:
            if key.startswith(prefix):
                return value
        return None

    # -- the c10d Store operations ---------------------------------------------------------
    def set(self, key: str, value: Any) -> None:
        self._op("set", key, value)
        self.data[key] = _b(value)

    def get(self, key: str) -> bytes:
        self._op("get", key)
        value = self._value(key)
        if value is None:  # a TCPStore would wait for it until its timeout
            raise StoreGone(f"store get {key}: timed out waiting for the key")
        self.received += len(value)
        return value

    def add(self, key: str, amount: int) -> int:
        self._op("add", key, amount)
        now = int((self._value(key) or b"0").decode()) + int(amount)
        self.data[key] = str(now).encode()
        self.received += 8
        return now

    def append(self, key: str, value: Any) -> None:
        self._op("append", key, value)
        self.data[key] = (self._value(key) or b"") + _b(value)

    def check(self, keys: Sequence[str]) -> bool:
        self._op("check", *keys)
        return all(self._value(k) is not None for k in keys)

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        self._op("wait", *keys)
        if not all(self._value(k) is not None for k in keys):
            raise StoreGone(f"store wait {list(keys)}: timed out")

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        self._op("multi_get", *keys)
        values = [self._value(k) for k in keys]
        if any(v is None for v in values):
            raise StoreGone("store multi_get: timed out waiting for the keys")
        self.received += sum(len(v) for v in values if v is not None)
        return [v for v in values if v is not None]

    def multi_set(self, keys: Sequence[str], values: Sequence[Any]) -> None:
        self._op("multi_set", *keys, *values)
        self.data.update({k: _b(v) for k, v in zip(keys, values, strict=True)})

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        self._op("compare_set", key, expected, desired)
        current = self._value(key)
        if (current is None and _b(expected) == b"") or current == _b(expected):
            self.data[key] = _b(desired)
        result = self.data.get(key, b"")
        self.received += len(result)
        return result

    def delete_key(self, key: str) -> bool:
        self._op("delete_key", key)
        return self.data.pop(key, None) is not None

    def set_timeout(self, timeout: timedelta) -> None:
        self._op("set_timeout")


@dataclass
class FileCounts:
    ops: collections.Counter[str] = field(default_factory=collections.Counter)
    bytes_read: int = 0
    bytes_written: int = 0
    entries_listed: int = 0

    @property
    def total(self) -> int:
        return sum(self.ops.values())


class _Counted:
    """A file object whose reads and writes are counted (everything else is the file's)."""

    def __init__(self, inner: Any, counts: FileCounts, fds: set[int]) -> None:
        self._inner, self._counts, self._fds = inner, counts, fds
        self._fd = inner.fileno()
        fds.add(self._fd)  # its fsync counts too

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __enter__(self) -> _Counted:
        self._inner.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        self._fds.discard(self._fd)
        return self._inner.__exit__(*exc)

    def close(self) -> None:
        self._fds.discard(self._fd)
        self._inner.close()

    def __iter__(self) -> Iterator[Any]:
        for line in self._inner:
            self._counts.bytes_read += len(line)
            yield line

    def read(self, *args: Any) -> Any:
        data = self._inner.read(*args)
        self._counts.bytes_read += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        n = int(self._inner.readinto(buffer) or 0)
        self._counts.bytes_read += n
        return n

    def readline(self, *args: Any) -> Any:
        data = self._inner.readline(*args)
        self._counts.bytes_read += len(data)
        return data

    def write(self, data: Any) -> int:
        n = int(self._inner.write(data))
        self._counts.bytes_written += n
        return n


class FileRecorder:
    """Counts file operations under ``root`` while active (a context manager)."""

    def __init__(self, root: Path) -> None:
        self.root = str(Path(root).absolute())
        self.counts = FileCounts()
        self._fds: set[int] = set()
        self._saved: dict[tuple[Any, str], Any] = {}

    def _mine(self, path: Any) -> bool:
        if isinstance(path, int):
            return path in self._fds
        try:
            return os.path.abspath(os.fsdecode(path)).startswith(self.root)
        except TypeError:
            return False

    def _patch(self, owner: Any, name: str, make: Any) -> None:
        original = getattr(owner, name)
        self._saved[(owner, name)] = original
        setattr(owner, name, make(original))

    def __enter__(self) -> FileRecorder:
        counts = self.counts

        def counted(kind: str) -> Any:
            def make(original: Any) -> Any:
                def call(path: Any, *args: Any, **kwargs: Any) -> Any:
                    if self._mine(path):
                        counts.ops[kind] += 1
                    return original(path, *args, **kwargs)
                return call
            return make

        def make_open(original: Any) -> Any:
            def call(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
                handle = original(file, mode, *args, **kwargs)
                if not self._mine(file):
                    return handle
                writing = any(c in mode for c in "wax+")
                counts.ops["open_write" if writing else "open_read"] += 1
                return _Counted(handle, counts, self._fds)
            return call

        def make_os_open(original: Any) -> Any:
            def call(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
                fd = int(original(path, flags, *args, **kwargs))
                if self._mine(path):
                    counts.ops["os_open"] += 1
                    self._fds.add(fd)
                return fd
            return call

        def make_listing(kind: str) -> Any:
            def make(original: Any) -> Any:
                def call(path: Any = ".", *args: Any, **kwargs: Any) -> Any:
                    result = original(path, *args, **kwargs)
                    if not self._mine(path):
                        return result
                    counts.ops[kind] += 1
                    if isinstance(result, list):
                        counts.entries_listed += len(result)
                        return result
                    entries = list(result)
                    counts.entries_listed += len(entries)
                    return _Listing(entries)
                return call
            return make

        def make_write(original: Any) -> Any:
            def call(fd: int, data: Any) -> int:
                n = int(original(fd, data))
                if fd in self._fds:
                    counts.ops["write"] += 1
                    counts.bytes_written += n
                return n
            return call

        def make_close(original: Any) -> Any:
            def call(fd: int) -> None:
                self._fds.discard(fd)
                original(fd)
            return call

        self._patch(builtins, "open", make_open)
        self._patch(io, "open", make_open)
        self._patch(os, "open", make_os_open)
        self._patch(os, "write", make_write)
        self._patch(os, "close", make_close)
        self._patch(os, "fsync", counted("fsync"))
        for name in ("stat", "lstat"):
            self._patch(os, name, counted("stat"))
        for name in ("replace", "rename"):
            self._patch(os, name, counted("rename"))
        for name in ("unlink", "remove"):
            self._patch(os, name, counted("unlink"))
        self._patch(os, "mkdir", counted("mkdir"))
        self._patch(os, "rmdir", counted("rmdir"))
        self._patch(os, "listdir", make_listing("listdir"))
        self._patch(os, "scandir", make_listing("scandir"))
        return self

    def __exit__(self, *exc: Any) -> None:
        for (owner, name), original in self._saved.items():
            setattr(owner, name, original)
        self._saved.clear()


class _Listing(list):  # type: ignore[type-arg]
    """A scandir result already read (and counted), usable as the iterator it was."""

    def __enter__(self) -> _Listing:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def close(self) -> None:
        return None


class SimulatedTime:
    """``time.sleep`` advances ``time.monotonic``/``time.time`` instead of waiting."""

    def __init__(self) -> None:
        self.now = 1_000_000.0
        self.slept = 0.0
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> SimulatedTime:
        def sleep(seconds: float) -> None:
            self.now += max(float(seconds), 0.0)
            self.slept += max(float(seconds), 0.0)

        for name, fake in (("sleep", sleep), ("monotonic", lambda: self.now),
                           ("time", lambda: self.now)):
            self._saved[name] = getattr(time, name)
            setattr(time, name, fake)
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, original in self._saved.items():
            setattr(time, name, original)


class SlurmCalls:
    """``subprocess.run`` recorded (and answered with success) while active: the Slurm
    commands a rank runs (scontrol requeue, squeue), counted by program."""

    def __init__(self) -> None:
        self.calls: collections.Counter[str] = collections.Counter()
        self._saved: Any = None

    def __enter__(self) -> SlurmCalls:
        self._saved = subprocess.run

        def run(args: Any, *rest: Any, **kwargs: Any) -> subprocess.CompletedProcess[str]:
            argv = [str(a) for a in (args if isinstance(args, list | tuple) else [args])]
            if argv[:2] == ["/bin/sh", "-c"]:  # slurm/relay.py's wrapper: the command after it
                argv = argv[4:]
            self.calls[" ".join(argv[:2])] += 1
            return subprocess.CompletedProcess(argv, 0, "", "")

        subprocess.run = run  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: Any) -> None:
        subprocess.run = self._saved

    @property
    def total(self) -> int:
        return sum(self.calls.values())


@contextmanager
def recording(root: Path) -> Iterator[tuple[FileRecorder, SimulatedTime, SlurmCalls]]:
    """All three at once, for one rank's piece of work."""
    with FileRecorder(root) as files, SimulatedTime() as clock, SlurmCalls() as slurm:
        yield files, clock, slurm
