"""``submit cluster.remote=HOST ...`` on a laptop: check here, copy the code, submit there.

1. Here, before any connection: the overrides compose and validate (a typo fails in a
   second, the usual one line), ``script=``/``--config-dir`` lie in the project.
2. One SSH connection (hpc_ddp/remote/ssh.py) for everything that follows: is hpc_ddp there,
   in the same version, and is this snapshot there already (one round trip); the archive
   when it is not (hpc_ddp/remote/snapshot.py); then hpc_ddp's own submit runs there, in the
   snapshot, with the arguments and the secrets they reference on its standard input
   (``--args-stdin``): no secret on a command line on either machine.
3. A small local run dir, the handle (hpc_ddp/remote/handle.py): where the run lives, which
   host, which snapshot, which job. ``status``/``logs`` take it as they take a run dir.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from hpc_ddp.errors import UserError
from hpc_ddp.remote import handle as handles
from hpc_ddp.remote.intent import TRUE, given
from hpc_ddp.remote.ssh import (
    SSH_FAILED,
    Ssh,
    command_line,
    control_dir,
    failure,
    remote_path,
    shell_words,
)
from hpc_ddp.version import VERSION

if TYPE_CHECKING:  # the type only: tarfile stays off the import
    from hpc_ddp.remote.snapshot import Snapshot

ARGS_STDIN = "--args-stdin"
DEFAULT_ROOT = "~/hpc_ddp"


@dataclasses.dataclass(frozen=True)
class Sent:
    """What a remote submit did: the remote submit's exit code, what it said on its standard
    error, and the local handle (None: nothing was submitted, or a dry run)."""

    status: int
    said: str = ""
    folder: Path | None = None


def submit(overrides: list[str], script_args: list[str] | None, multirun: bool,
           out: TextIO, environ: Mapping[str, str] = os.environ,
           cwd: Path | None = None) -> Sent:
    """The laptop's side (the module doc); ``cwd``: where the command was typed (the API's
    ``cwd=``), this process's own by default."""
    from hpc_ddp.config.compose import check_overrides  # deferred: the typed schemas

    cwd = Path.cwd() if cwd is None else cwd.absolute()
    previous = _resumed(overrides, cwd)
    check_overrides(_first_point(overrides) if multirun else overrides)
    at = _target(overrides, multirun, previous)
    host, python, root_text = at.host, at.python, at.root
    ssh = Ssh(host, control_dir(environ), at.ssh_config)
    from hpc_ddp.remote import snapshot as snap  # deferred: tarfile

    project = snap.project_root(cwd, at.remote_code)
    code = None if previous else snap.pack(project, snap.project_files(project))
    digest = previous.snapshot if previous else (code.digest if code else "")
    home = _probe(ssh, python, f"{root_text.rstrip('/')}/code/{digest}", code, out)
    if root_text == "~" or root_text.startswith("~/"):  # the paths it is given: absolute
        root_text = home + root_text[1:]
    code_dir = f"{root_text.rstrip('/')}/code/{digest}"
    remote_cwd = code_dir if previous else _under(code_dir, project, cwd)
    args = [_moved(o, project, code_dir) for o in overrides]
    stamp = _dt.datetime.now().strftime("%Y-%m-%d_%H-%M-%S-%f")[:-3]
    remote_dir, local_dir = _places(args, previous, root_text, stamp, multirun)
    args = [a for a in args if not a.lstrip("+").startswith(("run_dir=", "sweep.dir="))]
    args += [f"{'sweep.dir' if multirun else 'run_dir'}={remote_dir}", "cluster.remote=null"]
    secrets = {name: environ[name] for name in at.secrets if name in environ}
    payload = json.dumps({"args": args, "script_args": script_args, "multirun": multirun,
                          "env": secrets}).encode()
    print(f"hpc_ddp: submitting on {host} (code {digest}, run dir {remote_dir}) ...",
          file=out, flush=True)
    dry = given(overrides, "dry_run") in TRUE  # a dry run leaves no handle
    record = handles.Handle(host, remote_dir, digest, python, at.ssh_config,
                            previous.job_id if previous else None, multirun, root_text,
                            list(at.secrets))
    shown, local_dir = local_dir, cwd / local_dir  # as typed; where it is
    fresh = not (local_dir / handles.FILE).exists()
    if not dry:  # before the submit: a wait=true that is interrupted keeps its handle
        handles.write(local_dir, record)
    status, err = ssh.stream(command_line([*python, "-m", "hpc_ddp.submit", ARGS_STDIN],
                                          remote_cwd), out, stdin=payload)
    if status == SSH_FAILED:
        raise failure(host, err)
    sys.stderr.write(err)
    if status != 0 and fresh and not dry and _job_id(ssh, remote_dir) is None:
        (local_dir / handles.FILE).unlink(missing_ok=True)  # nothing was submitted
    if status != 0 or dry:
        return Sent(status, err)
    handles.write(local_dir, dataclasses.replace(record, job_id=_job_id(ssh, remote_dir)))
    where = shlex.quote(str(shown))
    print(f"  local handle: {shown}\n"
          f"  status:      python -m hpc_ddp.status {where} --watch\n"
          f"  logs:        python -m hpc_ddp.logs {where} --follow\n"
          f"  stop:        python -m hpc_ddp.status {where} --stop\n"
          f"  results:     python -m hpc_ddp.collect {where}", file=out, flush=True)
    return Sent(0, err, local_dir)


@dataclasses.dataclass(frozen=True)
class _Target:
    """Where a submit goes: the host and how to reach it, the interpreter and root there,
    the folder copied, the names of the secrets the config references (their values go on
    the connection's standard input)."""

    host: str
    python: list[str]
    ssh_config: str | None
    root: str
    remote_code: str | None = None
    secrets: tuple[str, ...] = ()


def _target(overrides: list[str], multirun: bool, previous: handles.Handle | None) -> _Target:
    """A new run's target from its config, composed and checked here; a resume's from its
    handle (the run's own host, interpreter and code: its config is on the cluster, where
    the resume merges these overrides into it and checks them)."""
    if previous is not None:
        return _Target(previous.host, previous.python, previous.ssh_config,
                       previous.root or DEFAULT_ROOT, None, tuple(previous.secrets))
    # deferred: the typed schemas; hpc_ddp.config.secrets
    from hpc_ddp.config.compose import compose
    from hpc_ddp.config.secrets import referenced

    cfg = compose(_first_point(overrides) if multirun else overrides)
    return _Target(cfg.cluster.remote or "", remote_python(cfg.cluster.python, cfg.cluster.venv),
                   cfg.cluster.ssh_config, cfg.cluster.remote_root or DEFAULT_ROOT,
                   cfg.cluster.remote_code, tuple(sorted(referenced(cfg))))


def remote_python(python: str | None, venv: str | None) -> list[str]:
    """The interpreter hpc_ddp runs with on the login node: cluster.python, else
    cluster.venv's, else the login shell's python3."""
    if python:
        return [python]
    if venv:
        return [f"{venv.rstrip('/')}/bin/python"]
    return ["python3"]


def _resumed(overrides: Sequence[str], cwd: Path) -> handles.Handle | None:
    run_dir = given(overrides, "run_dir")
    if run_dir and given(overrides, "resume") in TRUE:
        return handles.read(cwd / Path(run_dir).expanduser())
    return None


def _first_point(overrides: Sequence[str]) -> list[str]:
    """A sweep's first point, for what every point shares (cluster.remote and its kin)."""
    return [o.split(",")[0] if "=" in o and "," in o else o for o in overrides]


def _under(code_dir: str, project: Path, cwd: Path) -> str:
    """The remote twin of this folder: the command runs where it was typed, in the copy."""
    try:
        rel = cwd.resolve().relative_to(project)
    except ValueError:
        return code_dir
    return code_dir if str(rel) == "." else f"{code_dir}/{rel}"


def _moved(override: str, project: Path, code_dir: str) -> str:
    """``script=``/``config_dir=`` with a path of this machine: its twin in the copy; a path
    outside the project is refused (the cluster would not have it)."""
    name, eq, value = override.partition("=")
    if not eq or name.lstrip("+") not in ("script", "config_dir") or value.startswith("-m"):
        return override
    path = Path(value.strip("'\"")).expanduser()
    if not path.is_absolute():
        return override
    try:
        rel = path.resolve().relative_to(project)
    except ValueError:
        raise UserError(name.lstrip("+"), value, f"is outside the project copied to the "
                        f"cluster ({project}).", "move it into the project, or name a "
                        "folder holding both with cluster.remote_code=DIR.") from None
    return f"{name}={code_dir}/{rel}"


def _places(args: Sequence[str], previous: handles.Handle | None, root: str, stamp: str,
            multirun: bool) -> tuple[str, Path]:
    """(the run dir there, the handle here)."""
    key = "sweep.dir" if multirun else "run_dir"
    asked = given(args, key)
    if previous is not None and asked:
        return previous.remote_dir, Path(asked)
    if asked and not Path(asked).is_absolute():
        return f"{root.rstrip('/')}/runs/{asked}", Path(asked)
    if asked:
        return asked, Path("outputs") / "remote" / stamp
    return f"{root.rstrip('/')}/runs/{stamp}", Path("outputs") / stamp


def _probe(ssh: Ssh, python: list[str], code_dir: str, code: Snapshot | None,
           out: TextIO) -> str:
    """One round trip: the home folder there, hpc_ddp there and its version, the snapshot
    there or not; then the archive if it is not. Returns the home folder; raises UserError
    with the fix."""
    check = (f"echo \"$HOME\"; {shell_words(python)} -c 'import hpc_ddp; "
             "print(hpc_ddp.__version__)' || echo missing; "
             f"test -f {remote_path(code_dir)}/.complete && echo present || echo absent")
    said = ssh.run(check, timeout=120).stdout.decode(errors="replace").splitlines()
    home, said = (said[0], said[1:]) if said else ("", [])
    version = said[0].strip() if said else "missing"
    if version == "missing":
        raise UserError("cluster.remote", ssh.destination, f"has no hpc_ddp for "
                        f"{shlex.join(python)}.", f"install it there (pip install "
                        f"hpc_ddp=={VERSION}, or python -m hpc_ddp.env venv on "
                        "the cluster) and set cluster.venv= or cluster.python= to it.")
    if version != VERSION:
        raise UserError("cluster.remote", ssh.destination, f"runs hpc_ddp {version}, this "
                        f"machine {VERSION}: the two must match.",
                        f"install hpc_ddp=={VERSION} there (or this one's "
                        "version here).")
    if said[-1:] == ["present"] or code is None:
        return home
    archive = code.archive
    parent = remote_path(code_dir.rsplit("/", 1)[0])
    final = remote_path(code_dir)
    # Unpacked into a temporary folder and renamed: a copy cut short is never taken for
    # whole; two submits of the same tree at once both end with one copy.
    line = (f"set -e; mkdir -p {parent}; t=$(mktemp -d {parent}/.incoming.XXXXXX); "
            f"tar -x -f - -C \"$t\"; touch \"$t/.complete\"; "
            f"mv -T \"$t\" {final} 2>/dev/null || rm -rf \"$t\"")
    print(f"hpc_ddp: copying the code ({len(archive) // 1024} KiB) to {ssh.destination} ...",
          file=out, flush=True)
    done = ssh.run(line, stdin=archive, timeout=600)
    if done.returncode != 0:
        raise UserError("cluster.remote_root", code_dir.rsplit("/code/", 1)[0], "the code "
                        f"could not be unpacked there ({_last(done.stderr)}).",
                        "set cluster.remote_root= to a folder of yours on the cluster with "
                        "room for it.")
    return home


def _last(stderr: bytes) -> str:
    lines = stderr.decode(errors="replace").strip().splitlines()
    return lines[-1] if lines else "no message"


def _job_id(ssh: Ssh, remote_dir: str) -> str | None:
    done = ssh.run(f"cat {remote_path(remote_dir)}/job.json 2>/dev/null || true", timeout=60)
    try:
        return str(json.loads(done.stdout.decode() or "{}").get("job_id") or "") or None
    except ValueError:
        return None
