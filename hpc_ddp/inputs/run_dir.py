"""The run dir as a run's input: new or empty (or a run to resume), writable, its config and
overrides written once; the data a run reads checked before any rank starts."""

from __future__ import annotations

import os
import re
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from hpc_ddp.errors import UserError
from hpc_ddp.rundir import RunDir, write_text

if TYPE_CHECKING:  # the type only: the schema's dataclasses take ~0.1 s to build
    from hpc_ddp.config.schema import Config

# Command switches that belong to one invocation, not to the run.
TRANSIENT = ("resume", "wait", "detach", "dry_run", "preflight")


def saved_overrides(overrides: Sequence[str], cfg: Config | None = None) -> list[str]:
    """What overrides.yaml keeps: everything but the per-command switches, and of overrides
    of the same key only the last (a run resumed ten times keeps one ``optim.lr=``); paths
    as ``cfg`` resolved them (absolute), so a resume from another folder finds them."""
    from hpc_ddp.config.compose import quoted  # deferred: the typed schemas

    kept = [o for o in overrides if o.partition("=")[0].lstrip("+~") not in TRANSIENT]
    last = {o.partition("=")[0]: i for i, o in enumerate(kept)}
    kept = [o for i, o in enumerate(kept) if last[o.partition("=")[0]] == i]
    if cfg is None:
        return kept
    resolved = {"config_dir": cfg.config_dir, "script": cfg.script}
    return [f"{o.partition('=')[0]}={quoted(str(resolved[key]))}"
            if (key := o.partition("=")[0].lstrip("+")) in resolved and resolved[key] else o
            for o in kept]


def check_inputs(cfg: Config) -> None:
    """File-system checks of the inputs (before launch, so a rank never finds them broken)."""
    if cfg.data.name == "cifar10" and cfg.data.root:
        from hpc_ddp.data.cifar10 import check_root  # deferred (start-up): data.cifar10

        check_root(cfg.data.root)


def check_run_dir(cfg: Config, ranks: tuple[int, ...] | None = None) -> RunDir:
    """The run dir must be new or empty (or an existing run with resume=true) and writable.

    Only reads and a probe file in a new folder: an existing run is never modified here.
    ``ranks``: a task's own, on every task of a started job (check_run_files).
    """
    assert cfg.run_dir is not None
    run = RunDir(Path(cfg.run_dir))
    exists = run.root.exists()
    if exists and not run.root.is_dir():
        raise UserError("run_dir", cfg.run_dir, "is a file, not a folder.", "choose a folder.")
    if exists:
        check_owned_folder(run.root, "run_dir", cfg.run_dir, ranks)
    if cfg.resume:
        if not run.config.is_file():
            raise UserError("run_dir", cfg.run_dir, "holds no run to resume.",
                            "check the path, or drop resume=true to start a new run.")
    # A sweep point that never started holds only its hparams.json: it may be run by hand.
    elif exists and any(p != run.hparams for p in run.root.iterdir()):
        raise UserError("run_dir", cfg.run_dir, "already holds files; nothing there is touched.",
                        "pass resume=true to continue that run, or choose a new run_dir.")
    check_writable(run.root, cfg.run_dir)
    return run


def check_owned_folder(folder: Path, key: str, shown: str,
                       ranks: tuple[int, ...] | None = None) -> None:
    """An existing run dir (or sweep dir) must be this user's and writable by no one else:
    every code-bearing file in it is loaded only then (hpc_ddp/owned.py), so a run that could
    not be resumed is refused before it starts. ``ranks``: a task's own (check_run_files)."""
    # deferred (start-up): owned
    from hpc_ddp.owned import Untrusted, check_folder

    try:
        check_folder(folder)
    except Untrusted as exc:
        raise UserError(key, shown, str(exc), "") from None
    if key == "run_dir":  # a sweep's dir holds run dirs, not a run's own files
        check_run_files(RunDir(folder), shown, ranks)


# What the ranks and their supervisors append to (or replace) under logs/: each refuses a
# symbolic link or someone else's file when it opens it (owned.open_append), but a rank that
# refuses its own log stops alone while the others wait minutes for it at the rendezvous.
_RANK_FILE = re.compile(r"rank\d+\.(?:log|stacks|error)")


def check_run_files(run: RunDir, shown: str, ranks: tuple[int, ...] | None = None) -> None:
    """Before any rank starts (at submission and on every task of an sbatch job, as
    check_owned_folder): events.jsonl is no link and a regular file of this user's; logs/ is a
    real folder, this user's and writable by no one else; no rank's log, stacks or error file
    in it is a link or anything but a regular file. A planted one then stops the run at
    once, naming it. At submission (``ranks`` None) one listing of logs/ checks every rank's
    (each entry's type comes with it, d_type: no stat per rank); a task (``ranks``: its own)
    checks its own three names only, so that no task's cost grows with the world size (once
    submission found logs/ private, only this user could have planted one since). A regular
    file of someone else's there (only possible while logs/ was writable by them) is refused
    by the rank that opens it (owned.open_append)."""
    # deferred (start-up): events, owned
    from hpc_ddp.events import FILE
    from hpc_ddp.owned import Untrusted, check_appendable, check_stat

    try:
        try:
            check_appendable(os.lstat(run.root / FILE), run.root / FILE)
        except FileNotFoundError:
            pass
        try:
            fd = os.open(run.logs, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            return
        except OSError as exc:  # ELOOP: a link (O_NOFOLLOW); ENOTDIR: a file
            check_appendable(os.lstat(run.logs), run.logs)  # a link: refused as such
            raise Untrusted(f"{run.logs} is not a folder ({exc.strerror}). Fix: remove "
                            "it.") from None
        try:
            check_stat(os.fstat(fd), run.logs)
            if ranks is not None:
                for name in (f"rank{r}.{kind}" for r in ranks
                             for kind in ("log", "stacks", "error")):
                    try:
                        check_appendable(os.lstat(name, dir_fd=fd), run.logs / name)
                    except FileNotFoundError:
                        pass
                return
            with os.scandir(fd) as entries:
                for entry in entries:
                    if _RANK_FILE.fullmatch(entry.name) and not entry.is_file(
                            follow_symlinks=False):
                        check_appendable(entry.stat(follow_symlinks=False),
                                         run.logs / entry.name)
        finally:
            os.close(fd)
    except Untrusted as exc:
        raise UserError("run_dir", shown, str(exc), "") from None


# Folders this process found writable in the last seconds (a sweep's thousand run dirs
# share one parent: one probe for all); later checks probe again.
_WRITABLE: dict[Path, float] = {}


_WRITABLE_FOR_S = 5.0


def check_writable(folder: Path, shown: str) -> None:
    """Try for real (root ignores permission bits, read-only mounts do not): make and remove
    an empty probe folder in the run dir, or in its nearest existing parent."""

    existing = folder
    while not existing.exists():
        existing = existing.parent

    if time.monotonic() - _WRITABLE.get(existing, -_WRITABLE_FOR_S) < _WRITABLE_FOR_S:
        return
    try:
        if not existing.is_dir():
            raise NotADirectoryError(f"{existing} is a file")
        os.rmdir(tempfile.mkdtemp(prefix=".hpc_ddp_probe_", dir=existing))
    except OSError as exc:
        raise UserError("run_dir", shown, f"is not writable ({exc.strerror or exc}).",
                        "choose a folder you can write, e.g. run_dir=$HOME/runs/try1.") from None
    _WRITABLE[existing] = time.monotonic()


def read_saved(root: Path, name: str, shown: str) -> str | None:
    """The text of a file of the run dir ``root`` (config.yaml, overrides.yaml), read once the
    run dir and the file passed the ownership checks (hpc_ddp/owned.py: a `_target_` planted
    there would be code run here and on every rank); None when it is missing or unreadable;
    UserError naming ``shown`` (the run_dir as given) when someone else could have written it."""
    # deferred (start-up): owned
    from hpc_ddp.owned import Untrusted, read_owned

    try:
        return read_owned(root / name, root).decode()
    except Untrusted as exc:
        raise UserError("run_dir", shown, str(exc), "") from None
    except (OSError, UnicodeDecodeError):
        return None


def write_run_config(run: RunDir, cfg: Config, overrides: Sequence[str]) -> str:
    """config.yaml (resolved) and overrides.yaml (what a later resume=true starts from);
    returns config.yaml's text (what the ranks are handed, made once)."""
    import yaml  # deferred: the typed schemas, yaml

    from hpc_ddp.config.compose import to_yaml

    run.root.mkdir(parents=True, exist_ok=True)
    text = to_yaml(cfg)
    # Replaced, not written in place: a link planted at either name is not written through.
    write_text(run.config, text)
    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
    write_text(run.overrides, yaml.dump(saved_overrides(overrides, cfg), Dumper=dumper,
                                        default_flow_style=False))
    return text
