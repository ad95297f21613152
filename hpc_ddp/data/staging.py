"""One node's copy of a data set on its local disk: the source's fingerprint, the copy (a
folder copied, a tar extracted), the manifest that lets a later start reuse it.

Layout under ``data.stage_dir`` (docs/data.md)::

    <stage_dir>/hpc_ddp-stage-<uid>/<host>/<name>-<hash of the source path>/
        .lock                 held while one rank checks or stages (stage_node.py)
        <fingerprint>/        one staged version: data/ (the copy) + manifest.json
        <fingerprint>.inuse   every rank using that version holds a shared lock on it

Every folder from ``hpc_ddp-stage-<uid>`` down is this user's, mode 0700, checked at each
start (stage_folders.py). The manifest holds every copied file's SHA-256, computed from the
copy when it was made; a later start reuses a copy only when each file still has its size
and checksum (verify_copy), else it stages again.

The host is part of the path so that a stage_dir on a shared file system (by mistake, or the
test cluster's nodes, which share one machine) still gives every node its own copy. A version
is named by the source's fingerprint, so a changed source is staged beside a copy another job
may still read, never over it; versions nobody holds are removed when a new one is staged.

The fingerprint is cheap on purpose (rank 0 computes it once per job start, on the shared file
system): the source's directory listing (names, and each directory's modification time) and,
while the source has at most :data:`STAT_FILES_UP_TO` files, every file's size and mtime. A
tar (or any single file) is its size and mtime. What a big folder's fingerprint misses: a file
rewritten in place under the same name; touch its folder, or delete the copy, to re-stage.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import stat
import tarfile
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_ddp.data.stage_folders import top_of
from hpc_ddp.errors import UserError
from hpc_ddp.rundir import write_text

log = logging.getLogger(__name__)

# A folder with at most this many files has every file's size and mtime in its fingerprint;
# above it, its directory listing and directory mtimes only (a stat per file of a million-file
# folder on a shared file system is the load staging exists to avoid).
STAT_FILES_UP_TO = 100_000
# Files copied at once: a shared file system answers many small reads in parallel better
# than one after another (the node's other ranks are idle meanwhile).
COPY_THREADS = 8
# Seconds between progress lines.
PROGRESS_EVERY_S = 5.0
TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz")
MANIFEST = "manifest.json"
FORMAT = 2  # 2: the manifest holds each file's checksum


class StageSpaceError(UserError):
    """A node's stage_dir has less free space than the data set needs."""


@dataclass(frozen=True)
class Source:
    path: Path  # absolute
    kind: str  # "folder" | "tar"

    @property
    def key(self) -> str:
        """The copy's folder name: the source's name and a hash of its whole path."""
        digest = hashlib.sha256(str(self.path).encode()).hexdigest()[:8]
        name = self.path.name
        for suffix in TAR_SUFFIXES:
            name = name.removesuffix(suffix)
        return f"{name}-{digest}"


@dataclass(frozen=True)
class Staged:
    """One rank's view of its node's copy."""

    root: Path  # what to read instead of the source
    source: str
    bytes: int
    files: int
    seconds: float  # the staging's time (0 when reused)
    reused: bool
    by_me: bool  # this rank made the copy
    host: str


def source_of(root: str, key: str = "data.root") -> Source:
    """The thing to stage (a folder or a tar); UserError naming ``key`` if it is neither."""
    path = Path(root).expanduser().absolute()
    if path.is_dir():
        return Source(path, "folder")
    if path.is_file() and path.name.endswith(TAR_SUFFIXES):
        return Source(path, "tar")
    problem = ("does not exist" if not path.exists() else
               "is a file but not a tar archive (.tar, .tar.gz, .tgz, .tar.bz2, .tar.xz)")
    raise UserError(key, root, f"{problem}: there is nothing to stage.",
                    "point it at the data set's folder or at a tar of it.")


def default_stage_dir(environ: Mapping[str, str]) -> str:
    """``$SLURM_TMPDIR``, else ``$TMPDIR``, else /tmp: node-local disk on nearly every cluster
    (docs/data.md says why a copy there may not outlive the job)."""
    return environ.get("SLURM_TMPDIR") or environ.get("TMPDIR") or "/tmp"


def home_of(stage_dir: str, host: str, source: Source) -> Path:
    return top_of(stage_dir) / host / source.key


def fingerprint(source: Source, stat_files_up_to: int = STAT_FILES_UP_TO) -> str:
    """A short hash that changes when the source does (the module docstring says what counts)."""
    digest = hashlib.sha256(f"{FORMAT}:{source.kind}:{source.path}".encode())
    if source.kind == "tar":
        st = source.path.stat()
        digest.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
        return digest.hexdigest()[:16]
    files: list[os.DirEntry[str]] = []
    for folder, dir_mtime, entries in _walk(source.path):
        digest.update(f"d {folder} {dir_mtime}\n".encode())
        for entry in entries:
            digest.update(f"  {entry.name}\n".encode())
            if not entry.is_dir():
                files.append(entry)
    if len(files) <= stat_files_up_to:
        for entry in files:
            st = entry.stat()
            digest.update(f"f {entry.path} {st.st_size} {st.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def _walk(top: Path) -> Iterator[tuple[str, int, list[os.DirEntry[str]]]]:
    """(folder relative to ``top``, its mtime, its entries sorted by name), folders in order."""
    stack = [top]
    while stack:
        folder = stack.pop()
        with os.scandir(folder) as it:
            entries = sorted(it, key=lambda e: e.name)
        yield os.path.relpath(folder, top), folder.stat().st_mtime_ns, entries
        stack.extend(Path(e.path) for e in reversed(entries) if e.is_dir())


def read_manifest(version: Path, fp: str) -> dict[str, Any] | None:
    """The manifest of a complete copy of fingerprint ``fp`` (None: missing, other, broken,
    or of a format without checksums). A copy whose file count no longer matches (a tmp
    cleaner removed files) is not reused."""
    try:
        manifest = json.loads((version / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("fingerprint") != fp or not isinstance(
            manifest.get("checksums"), dict):
        return None
    data = version / "data"
    try:
        count = sum(len([e for e in entries if not e.is_dir()]) for _, _, entries in _walk(data))
    except OSError:
        return None
    return manifest if count == manifest.get("files") else None


def manifest_of(version: Path) -> dict[str, Any]:
    """The manifest of a copy known to be complete (read_manifest checked it in this job)."""
    data: dict[str, Any] = json.loads((version / MANIFEST).read_text())
    return data


def needed_bytes(source: Source) -> tuple[int, bool]:
    """(bytes the copy takes, exact?): a folder's file sizes, an uncompressed tar's size; a
    compressed tar's size is only a lower bound."""
    if source.kind == "tar":
        exact = source.path.name.endswith(".tar")
        return source.path.stat().st_size, exact
    return sum(size for _, _, size in _files(source.path)), True


def _files(top: Path) -> Iterator[tuple[Path, str, int]]:
    """(file, its path relative to ``top``, size) of every file under ``top``."""
    for folder, _, entries in _walk(top):
        for entry in entries:
            if not entry.is_dir():
                yield Path(entry.path), os.path.join(folder, entry.name), entry.stat().st_size


def check_space(home: Path, needed: int, exact: bool, host: str, stage_dir: str) -> None:
    """StageSpaceError naming the node, the bytes needed and free, before anything is copied."""
    free = shutil.disk_usage(home).free
    if needed > free:
        raise space_error(host, needed, free, exact, stage_dir)


def space_error(host: str, needed: int, free: int, exact: bool, stage_dir: str
                ) -> StageSpaceError:
    at_least = "" if exact else "at least "
    return StageSpaceError(
        "data.stage_dir", stage_dir,
        f"node {host} has {gib(free)} free there but the data set needs {at_least}"
        f"{gib(needed)} ({needed} bytes needed, {free} free).",
        "free space there, point data.stage_dir at a larger node-local disk, or set "
        "data.stage=false to read the data where it is.")


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


class Progress:
    """Bytes done of a total, as a log line every ``every_s`` (and to ``report``)."""

    def __init__(self, what: str, total: int, report: Callable[[dict[str, Any]], None] | None,
                 every_s: float = PROGRESS_EVERY_S) -> None:
        self.what, self.total, self.report, self.every_s = what, total, report, every_s
        self.done = 0
        self.started = self.last = time.monotonic()

    def add(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if now - self.last >= self.every_s:
            self.last = now
            self.emit()

    def emit(self) -> None:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        rate = self.done / elapsed
        share = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        log.info("staging %s: %s of %s%s, %.1f MB/s", self.what, gib(self.done),
                 gib(self.total), share, rate / 1e6)
        if self.report is not None:
            self.report({"done": self.done, "total": self.total, "rate": rate})


def make_copy(source: Source, target: Path, progress: Progress) -> tuple[int, int]:
    """Copy or extract ``source`` into ``target``/data; (files, bytes) of the copy."""
    data = target / "data"
    data.mkdir(parents=True)
    if source.kind == "tar":
        return _extract(source.path, data, progress)
    files = list(_files(source.path))
    for rel in sorted({os.path.dirname(rel) for _, rel, _ in files}):
        (data / rel).mkdir(parents=True, exist_ok=True)

    def one(item: tuple[Path, str, int]) -> int:
        shutil.copyfile(item[0], data / item[1])
        return item[2]

    with ThreadPoolExecutor(COPY_THREADS) as pool:
        for size in pool.map(one, files):
            progress.add(size)
    return len(files), sum(size for _, _, size in files)


class _Counted:
    """A file object that counts the bytes read through it (tar extraction's progress)."""

    def __init__(self, raw: Any, progress: Progress) -> None:
        self.raw, self.progress = raw, progress

    def read(self, n: int = -1) -> bytes:
        chunk: bytes = self.raw.read(n)
        self.progress.add(len(chunk))
        return chunk


def _extract(path: Path, data: Path, progress: Progress) -> tuple[int, int]:
    files = size = 0
    with open(path, "rb") as raw, tarfile.open(fileobj=_Counted(raw, progress),  # type: ignore[call-overload]
                                               mode="r|*") as tar:
        for member in tar:
            # The "data" filter refuses absolute paths, links out of the folder and device
            # files (https://docs.python.org/3/library/tarfile.html#tarfile.data_filter).
            tar.extract(member, data, filter="data")
            if not member.isdir():  # what the copy's file count sees (links included)
                files, size = files + 1, size + member.size
    return files, size


def data_root(version: Path, kind: str) -> Path:
    """What replaces the source: the copy of a folder; of a tar, the one folder it held
    (imagenet.tar -> imagenet/), else what it held."""
    data = version / "data"
    if kind == "tar":
        entries = list(data.iterdir())
        if len(entries) == 1 and entries[0].is_dir() and not entries[0].is_symlink():
            return entries[0]
    return data


def write_manifest(version: Path, source: Source, fp: str, files: int, size: int,
                   seconds: float, host: str) -> None:
    """The copy's record, with each file's size and SHA-256 (read back from the copy)."""
    write_text(version / MANIFEST, json.dumps({
        "format": FORMAT, "source": str(source.path), "kind": source.kind, "fingerprint": fp,
        "files": files, "bytes": size, "seconds": round(seconds, 3), "host": host,
        "staged_at": time.time(), "checksums": checksums(version / "data")}, indent=2) + "\n")


def checksums(data: Path) -> dict[str, list[Any]]:
    """{path relative to ``data``: [size, SHA-256]} of every file of a copy (read in
    parallel: the node's local disk, the other ranks idle meanwhile)."""
    files = list(_files(data))

    def one(item: tuple[Path, str, int]) -> tuple[str, list[Any]]:
        digest = hashlib.sha256()
        with open(item[0], "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
        return item[1], [item[2], digest.hexdigest()]

    with ThreadPoolExecutor(COPY_THREADS) as pool:
        return dict(pool.map(one, files))


def verify_copy(version: Path, manifest: dict[str, Any]) -> str | None:
    """None when every file of the copy has the size and checksum the manifest recorded when
    it was made; else the first difference, in words."""
    try:
        found = checksums(version / "data")
    except OSError as exc:
        return f"it cannot be read ({exc.strerror or exc})"
    wanted = manifest["checksums"]
    for rel in sorted(set(wanted) | set(found)):
        if rel not in found:
            return f"{rel} is missing"
        if rel not in wanted:
            return f"{rel} was not staged"
        if list(found[rel]) != list(wanted[rel]):
            return f"{rel} differs from what was staged"
    return None


def is_no_space(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def remove_tree(path: Path) -> None:
    """Remove a copy, read-only folders (a tar may hold them) included; nothing if absent."""
    if not path.exists():
        return
    try:
        shutil.rmtree(path)
    except PermissionError:
        for folder, _, _ in os.walk(path):
            os.chmod(folder, stat.S_IRWXU)
        shutil.rmtree(path)
