"""The project's code as the cluster will run it: a content-addressed copy under the remote
root (``<cluster.remote_root>/code/<digest>``).

Which files: in a git work tree, those git would put in a commit now: tracked ones as they
are on disk (uncommitted changes included) and untracked ones that are not ignored (the file
just created and not yet added is there; ``.gitignore``d data, checkpoints and venvs are
not). Outside git, every file under the folder but version-control folders, caches and run
outputs. Either way, files that look like credentials (``.env``, ``.netrc``, ``.ssh/``,
``*.pem``, ``id_ed25519`` ...) are left out unless git tracks them, and the submit says
which (docs/security.md#the-remote-path). The archive is byte-for-byte the same for the
same files (sorted, no times, no owners), so its digest names the tree: the same tree twice
copies nothing, and a run records the digest it ran (a requeue or a resume runs that same
copy whatever the laptop holds by then).
"""

from __future__ import annotations

import hashlib
import io
import os
import stat
import subprocess
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from hpc_ddp.errors import UserError

# Outside git: folders never copied (version control, caches, what runs write).
SKIPPED = frozenset({".git", ".hg", ".svn", "__pycache__", ".mypy_cache", ".ruff_cache",
                     ".pytest_cache", ".ipynb_checkpoints", "outputs", "multirun", ".venv",
                     "venv", "node_modules"})
# A copy above this many bytes is refused with the fix (data belongs on the cluster).
MAX_BYTES = 200 * 2**20
DIGEST_CHARS = 16


@dataclass(frozen=True)
class Snapshot:
    root: Path            # the project folder on this machine
    files: tuple[str, ...]  # relative, sorted
    archive: bytes        # an uncompressed tar of them
    digest: str           # DIGEST_CHARS hex of the archive's SHA-256


def git_root(folder: Path) -> Path | None:
    """The top of the git work tree ``folder`` is in, or None (no git, or not a tree)."""
    try:
        done = subprocess.run(["git", "-C", str(folder), "rev-parse", "--show-toplevel"],
                              capture_output=True, text=True, timeout=30, check=False)
    except FileNotFoundError:
        return None
    top = done.stdout.strip()
    return Path(top) if done.returncode == 0 and top else None


# Files that hold credentials by their name: left out of a copy unless git tracks them (a
# file you committed is one you meant to ship); the submit names what it left out.
SECRET_NAMES = frozenset({".env", ".netrc", "_netrc", ".pgpass", ".pypirc", ".npmrc",
                          ".git-credentials", ".htpasswd", "credentials", ".s3cfg",
                          ".boto", ".dockercfg", "id_rsa", "id_dsa", "id_ecdsa",
                          "id_ed25519", "id_ecdsa_sk", "id_ed25519_sk", "kubeconfig"})
SECRET_SUFFIXES = (".pem", ".key", ".p12", ".pfx", ".jks", ".keystore", ".kdbx", ".gpg",
                   ".asc", ".ppk")
SECRET_FOLDERS = frozenset({".ssh", ".gnupg", ".aws", ".azure", ".kube", ".docker",
                            ".config/gcloud", ".password-store"})


def secret_looking(name: str) -> bool:
    """Does the path ``name`` (relative) look like a credential: a key, a token file, a
    folder of them (``.env.local``, ``.ssh/id_ed25519``, ``certs/server.key``)."""
    parts = Path(name).parts
    base = parts[-1]
    folders = {"/".join(parts[i:j]) for i in range(len(parts) - 1)
               for j in range(i + 1, len(parts))}
    return (base in SECRET_NAMES or base.startswith(".env.") or base.endswith(SECRET_SUFFIXES)
            or bool(folders & SECRET_FOLDERS))


def project_files(root: Path, left_out: list[str] | None = None) -> list[str]:
    """The files of the project at ``root`` (relative paths, sorted); see the module doc.
    Secret-looking files (:func:`secret_looking`) that git does not track are left out and
    appended to ``left_out``."""
    if git_root(root) is not None:
        names, tracked = _git_files(root, "--others", "--exclude-standard"), _git_files(root)
        names |= tracked
        # deleted but still tracked: not on disk, not in the copy
        found = [n for n in names if ((root / n).is_file() or (root / n).is_symlink())
                 and not _ours(root, n)]
    else:
        tracked = set()
        found = []
        for folder, dirs, files in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d not in SKIPPED)
            rel = Path(folder).relative_to(root)
            found.extend(str(rel / f) if str(rel) != "." else f for f in files)
        found = [n for n in found if not _ours(root, n)]
    secret = sorted(n for n in found if n not in tracked and secret_looking(n))
    if left_out is not None:
        left_out.extend(secret)
    return sorted(set(found) - set(secret))


def _git_files(root: Path, *which: str) -> set[str]:
    """``git ls-files`` of the tracked files (and ``which`` more) under ``root``."""
    done = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", *which,
                           "--", "."], capture_output=True, timeout=120, check=False)
    if done.returncode != 0:
        raise UserError("cluster.remote_code", str(root), "git could not list its files "
                        f"({done.stderr.decode(errors='replace').strip()}).",
                        "run git status there and fix what it says.")
    return {n for n in done.stdout.decode().split("\0") if n}


def _ours(root: Path, name: str) -> bool:
    """A file hpc_ddp wrote (a run's outputs, a remote run's handle): never code. Without
    this the handle of the last submit would change the next snapshot."""
    parts = Path(name).parts
    return parts[0] in ("outputs", "multirun") or any(
        (root.joinpath(*parts[:i]) / "remote.json").is_file() for i in range(1, len(parts)))


def pack(root: Path, files: Iterable[str]) -> Snapshot:
    """The archive of ``files`` under ``root`` and its digest. A symlink is kept as a link
    when it points inside the project, refused otherwise (the cluster would not have what it
    points to)."""
    names = sorted(set(files))
    buffer = io.BytesIO()
    total = 0
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in names:
            path = root / name
            info = tarfile.TarInfo(name)
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            mode = path.lstat().st_mode
            if stat.S_ISLNK(mode):
                target = os.readlink(path)
                inside = (path.parent / target).resolve()
                if not inside.is_relative_to(root.resolve()):
                    raise UserError("cluster.remote_code", name, f"is a link to {target}, "
                                    "outside the project: the cluster would not have it.",
                                    "copy the file into the project, or add the link to "
                                    ".gitignore and put the file on the cluster yourself.")
                info.type, info.linkname, info.mode = tarfile.SYMTYPE, target, 0o777
                tar.addfile(info)
                continue
            data = path.read_bytes()
            total += len(data)
            if total > MAX_BYTES:
                raise UserError("cluster.remote_code", str(root), f"holds more than "
                                f"{MAX_BYTES // 2**20} MiB of files to copy ({name} and "
                                "before): code is copied with every change, data is not.",
                                "put data and checkpoints on the cluster and list them in "
                                ".gitignore, or name a smaller folder with "
                                "cluster.remote_code=DIR.")
            info.size = len(data)
            info.mode = 0o755 if mode & 0o111 else 0o644
            tar.addfile(info, io.BytesIO(data))
    archive = buffer.getvalue()
    digest = hashlib.sha256(archive).hexdigest()[:DIGEST_CHARS]
    return Snapshot(root, tuple(names), archive, digest)


def project_root(cwd: Path, named: str | None) -> Path:
    """The folder that is copied: ``cluster.remote_code`` when given, else the git work tree
    ``cwd`` is in, else ``cwd`` itself."""
    if named:
        root = (cwd / Path(named).expanduser()).resolve()
        if not root.is_dir():
            raise UserError("cluster.remote_code", named, "is not a folder here.",
                            "name the project folder to copy (or leave it unset: the git "
                            "work tree you submit from).")
        return root
    return git_root(cwd) or cwd.resolve()
