"""Stage a data set once per node: the node's local rank 0 copies it, the node's other ranks
wait for it, then every rank reads the local copy (staging.py makes the copy).

What it costs at 1,000 nodes x 8 ranks, per rank and independent of the world size:
- rank 0 fingerprints the source once per job start (its listing, on the shared file system)
  and publishes it in the rendezvous store; no other rank touches the source unless its node
  must stage;
- every rank makes a fixed handful of store requests: at most two waits, which the store
  answers when the key is set (TCPStore holds a WAIT on the server and replies when the key
  arrives: no client polls; torch/csrc/distributed/c10d/TCPStore.cpp), and a few sets,
  checks and gets of short values;
- the node-level barrier is a lock file on the node's own disk: the others block in
  ``flock`` until the stager releases it (the kernel wakes them; nothing is polled, nothing
  reaches the shared file system), and a stager that dies releases it with its process, so a
  waiting rank takes over instead of hanging;
- one small all-reduce at the end, so every rank fails together, with the failing node's
  message, instead of waiting in the first training collective.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

from hpc_ddp.data import stage_folders, staging
from hpc_ddp.data.staging import Source, Staged
from hpc_ddp.errors import UserError
from hpc_ddp.rank.join.distenv import DistEnv

log = logging.getLogger(__name__)

# How long a rank waits for rank 0's fingerprint (a large folder's listing on a slow file
# system) and for its node's stager to take the lock.
WAIT_S = 3600.0
_NO_NODE = 1 << 30
# Locks this process holds while it uses a copy (released when the process ends).
_HELD: list[IO[str]] = []


def release() -> None:
    """Let go of the copies this process used (its end does the same; for tests)."""
    while _HELD:
        _HELD.pop().close()


class StageFailed(UserError):
    """Staging failed on some node; every rank raises it with that node's message."""

    def __init__(self, text: str) -> None:
        self.text = text
        super().__init__("data.stage", True, text, "")

    @property
    def message(self) -> str:
        return self.text


def stage(root: str, stage_dir: str | None, env: DistEnv, host: str, store: Any,
          environ: Mapping[str, str], report: Callable[[dict[str, Any]], None] | None = None,
          key: str = "data.root") -> Staged:
    """This node's copy of ``root`` (made here if needed); every rank of the job calls it.
    ``store``: the rendezvous store (None: this process is alone, it stages for itself)."""

    alone = store is None
    store = _OwnStore() if store is None else store
    # Keys of this staging in the store: the same on every rank, whatever fails below.
    prefix = f"hpc_ddp/stage/{env.restart}/{hashlib.sha256(root.encode()).hexdigest()[:12]}"
    node_key = f"{prefix}/n{env.node_rank}"
    failure: BaseException | None = None
    try:  # every failure is agreed on below, so that no rank waits for a failed one
        base = _expanded(stage_dir, environ, host) if stage_dir else \
            staging.default_stage_dir(environ)
        source = staging.source_of(root, key)
        fp = _fingerprint(source, env.is_master or alone, store, prefix)
        staged = _on_node(source, fp, base, env.local_rank == 0 or alone, host, store,
                          node_key, report)
    except (UserError, OSError) as exc:
        failure = exc
        if not store.check([f"{node_key}/failed"]):
            store.set(f"{node_key}/failed", _text(exc))
    _agree(env, store, prefix, failure)
    if failure is not None:
        raise failure
    return staged


def _expanded(stage_dir: str, environ: Mapping[str, str], host: str) -> str:
    """``$VARS`` of this node's environment (data.stage_dir='$SLURM_TMPDIR/x') and ``~``."""

    def value(match: re.Match[str]) -> str:
        name = match[1] or match[2]
        if name not in environ:
            raise UserError("data.stage_dir", stage_dir, f"names ${name}, which is not set on "
                            f"node {host}.", "name a variable every node sets, or a path.")
        return environ[name]

    return os.path.expanduser(re.sub(r"\$\{(\w+)\}|\$(\w+)", value, stage_dir))


def _text(exc: BaseException) -> str:
    return getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"


def _fingerprint(source: Source, mine: bool, store: Any, prefix: str) -> str:
    """Rank 0's fingerprint of the source, published once (a failure too, for every rank)."""
    key = f"{prefix}/fingerprint"
    if mine:
        try:
            fp = staging.fingerprint(source)
        except OSError as exc:
            store.set(key, f"!{exc}")
            raise UserError("data.root", str(source.path), f"cannot be read ({exc}).",
                            "check the path and its permissions.") from None
        store.set(key, fp)
        return fp
    store.wait([key], timedelta(seconds=WAIT_S))
    value = bytes(store.get(key)).decode()
    if value.startswith("!"):
        raise UserError("data.root", str(source.path), f"cannot be read on rank 0 "
                        f"({value[1:]}).", "check the path and its permissions.")
    return value


def _on_node(source: Source, fp: str, base: str, leader: bool, host: str, store: Any,
             node_key: str, report: Callable[[dict[str, Any]], None] | None) -> Staged:
    home = staging.home_of(base, host, source)
    try:
        Path(base).expanduser().mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError("data.stage_dir", base, f"cannot be made on node {host} "
                        f"({exc.strerror or exc}).", "choose a node-local folder you can "
                        "write (the default is $SLURM_TMPDIR, else $TMPDIR, else /tmp).") from None
    stage_folders.own_folders(stage_folders.top_of(base), home, base, host)
    inuse = _open_lock(home / f"{fp}.inuse", base, host)
    _flock(inuse, fcntl.LOCK_SH, base, host)  # no other job removes this version meanwhile
    _HELD.append(inuse)
    lock = _open_lock(home / ".lock", base, host)
    try:
        if leader:
            if not _try_flock(lock, fcntl.LOCK_EX, base, host):
                log.info("staging: another job on %s is staging %s; waiting for it", host,
                         source.path)
                store.set(f"{node_key}/held", "1")
                _flock(lock, fcntl.LOCK_EX, base, host)
            else:
                store.set(f"{node_key}/held", "1")
            return _use_or_make(source, fp, home, base, host, store, node_key, report)
        store.wait([f"{node_key}/held"], timedelta(seconds=WAIT_S))
        _flock(lock, fcntl.LOCK_SH, base, host)  # granted once the leader is done (or dead)
        if store.check([f"{node_key}/failed"]):  # the leader failed: its reason, no retry
            raise StageFailed(bytes(store.get(f"{node_key}/failed")).decode())
        if store.check([f"{node_key}/ok"]) and bytes(store.get(f"{node_key}/ok")).decode() == fp:
            return _reuse(home / fp, source, host, staging.manifest_of(home / fp), quiet=True)
        # The leader died before it finished: take over (the first to get the lock stages).
        fcntl.flock(lock, fcntl.LOCK_UN)
        _flock(lock, fcntl.LOCK_EX, base, host)
        return _use_or_make(source, fp, home, base, host, store, node_key, report)
    except (UserError, OSError) as exc:
        # Said before the lock is released, so the node's waiting ranks read it instead of
        # trying again.
        store.set(f"{node_key}/failed", _text(exc))
        raise
    finally:
        fcntl.flock(lock, fcntl.LOCK_UN)
        lock.close()


def _use_or_make(source: Source, fp: str, home: Path, base: str, host: str, store: Any,
                 node_key: str, report: Callable[[dict[str, Any]], None] | None) -> Staged:
    """Holding the node's lock: reuse a complete copy of this version, or make one."""
    version = home / fp
    manifest = staging.read_manifest(version, fp)
    changed = staging.verify_copy(version, manifest) if manifest is not None else None
    if changed:
        log.warning("staging: the copy of %s on %s at %s is not what was staged (%s); "
                    "staging it again", source.path, host, version, changed)
    if manifest is not None and not changed:
        staged = _reuse(version, source, host, manifest, quiet=False)
    else:
        staged = _make(source, fp, home, base, host, report)
    store.set(f"{node_key}/ok", fp)
    return staged


def _reuse(version: Path, source: Source, host: str, manifest: dict[str, Any],
           quiet: bool) -> Staged:
    if not quiet:
        log.info("staging: reusing the copy of %s on %s at %s (%s, %d files, staged %s)",
                 source.path, host, version, staging.gib(manifest["bytes"]), manifest["files"],
                 time.strftime("%Y-%m-%d %H:%M", time.localtime(manifest["staged_at"])))
    return Staged(staging.data_root(version, source.kind), str(source.path),
                  int(manifest["bytes"]), int(manifest["files"]), 0.0, True, False, host)


def _make(source: Source, fp: str, home: Path, base: str, host: str,
          report: Callable[[dict[str, Any]], None] | None) -> Staged:
    started = time.monotonic()
    partial = home / f"{fp}.partial"
    staging.remove_tree(partial)  # a stager that died left it
    staging.remove_tree(home / fp)  # incomplete or damaged
    _remove_unused_versions(home, fp)
    needed, exact = staging.needed_bytes(source)
    staging.check_space(home, needed, exact, host, base)
    log.info("staging %s (%s) to %s on %s: %s", source.path, source.kind, home / fp, host,
             staging.gib(needed))
    progress = staging.Progress(str(source.path), needed, report)
    try:
        files, size = staging.make_copy(source, partial, progress)
    except BaseException as exc:
        free = _free(home)
        staging.remove_tree(partial)  # leave the disk as it was
        if staging.is_no_space(exc):
            raise staging.space_error(host, needed, free, exact, base) from None
        raise
    seconds = time.monotonic() - started
    staging.write_manifest(partial, source, fp, files, size, seconds, host)
    os.replace(partial, home / fp)
    progress.emit()
    log.info("staged %s on %s: %d files, %s in %.1fs (%.1f MB/s) at %s", source.path, host,
             files, staging.gib(size), seconds, size / max(seconds, 1e-9) / 1e6, home / fp)
    return Staged(staging.data_root(home / fp, source.kind), str(source.path), size, files,
                  seconds, False, True, host)


def _remove_unused_versions(home: Path, keep: str) -> None:
    """Earlier versions of this source that no job holds: their space is needed now."""
    for marker in home.glob("*.inuse"):
        version = marker.name.removesuffix(".inuse")
        if version == keep:
            continue
        with open(marker, "a") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a running job reads it
            staging.remove_tree(home / version)
            staging.remove_tree(home / f"{version}.partial")
            marker.unlink(missing_ok=True)
            log.info("staging: removed the unused earlier copy %s", home / version)


def _free(home: Path) -> int:
    try:
        return shutil.disk_usage(home).free
    except OSError:
        return 0


def _open_lock(path: Path, base: str, host: str) -> IO[str]:
    try:
        return open(path, "a")
    except OSError as exc:
        raise UserError("data.stage_dir", base, f"cannot be written on node {host} "
                        f"({exc.strerror or exc}).", "choose a node-local folder you can "
                        "write.") from None


def _try_flock(handle: IO[str], mode: int, base: str, host: str) -> bool:
    try:
        _flock(handle, mode | fcntl.LOCK_NB, base, host)
        return True
    except BlockingIOError:
        return False


def _flock(handle: IO[str], mode: int, base: str, host: str) -> None:
    try:
        fcntl.flock(handle, mode)
    except BlockingIOError:
        raise
    except OSError as exc:  # ENOLCK, EOPNOTSUPP: a file system without locks
        raise UserError("data.stage_dir", base, f"does not support file locks on node {host} "
                        f"({exc.strerror or exc}): is it a shared file system?",
                        "stage to node-local disk ($SLURM_TMPDIR, $TMPDIR, /tmp, /local)."
                        ) from None


def _agree(env: DistEnv, store: Any, prefix: str, failure: BaseException | None) -> None:
    """Every rank learns whether some node failed; all raise the first such node's message."""
    import torch.distributed as dist  # deferred: torch

    if not (dist.is_available() and dist.is_initialized()) or env.world_size == 1:
        return
    import torch  # deferred: torch

    device = (torch.device("cuda", torch.cuda.current_device())
              if dist.get_backend() == "nccl" else torch.device("cpu"))
    first = torch.tensor([env.node_rank if failure is not None else _NO_NODE],
                         dtype=torch.int64, device=device)
    dist.all_reduce(first, op=dist.ReduceOp.MIN)
    node = int(first.item())
    if node == _NO_NODE or failure is not None:
        return
    raise StageFailed(bytes(store.get(f"{prefix}/n{node}/failed")).decode())


class _OwnStore:
    """A store for a process alone (no rendezvous store): keys in a dict."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.values[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.values[key]

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        missing = [k for k in keys if k not in self.values]
        if missing:
            raise RuntimeError(f"no rank publishes {missing} in a run without a store")

    def check(self, keys: list[str]) -> bool:
        return all(k in self.values for k in keys)
