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
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from hpc_ddp.config.given import flag, text
from hpc_ddp.errors import UserError
from hpc_ddp.remote import handle as handles
from hpc_ddp.remote.ssh import (
    SSH_FAILED,
    Ssh,
    command_line,
    control_dir,
    failure,
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
    at = _target(overrides, multirun, previous, script_args or [])
    host, python, root_text = at.host, at.python, at.root
    ssh = Ssh(host, control_dir(environ), at.ssh_config)
    from hpc_ddp.remote import snapshot as snap  # deferred: tarfile

    project = snap.project_root(cwd, at.remote_code)
    left_out: list[str] = []
    code = None if previous else snap.pack(project, snap.project_files(project, left_out))
    if left_out:
        listed = ", ".join(left_out[:5]) + (f" and {len(left_out) - 5} more"
                                            if len(left_out) > 5 else "")
        print(f"hpc_ddp: left out of the copy, as they look like credentials: {listed} (a "
              "job that needs one: put it on the cluster yourself, or commit it if it is "
              "not secret).", file=out, flush=True)
    digest = previous.snapshot if previous else (code.digest if code else "")
    home = _probe(ssh, python, root_text, digest, code, out)
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
                          "env": secrets}).encode() + b"\n"  # one line: the input stays open
    print(f"hpc_ddp: submitting on {host} (code {digest}, run dir {remote_dir}) ...",
          file=out, flush=True)
    dry = flag(overrides, "dry_run")  # a dry run leaves no handle
    record = handles.Handle(host, remote_dir, digest, python, at.ssh_config,
                            previous.job_id if previous else None, multirun, root_text,
                            list(at.secrets))
    shown, local_dir = local_dir, cwd / local_dir  # as typed; where it is
    fresh = not (local_dir / handles.FILE).exists()
    if not dry:  # before the submit: a wait=true that is interrupted keeps its handle
        handles.write(local_dir, record)
    # -P: the snapshot's folder is not put first on sys.path before the submit there has
    # checked it (hpc_ddp/submit.py args_from_stdin adds it then)
    line = command_line([*python, "-P", "-m", "hpc_ddp.submit", ARGS_STDIN], remote_cwd)
    try:  # tethered: killed or cut off here, the submit there ends too (remote/tether.py)
        status, err = ssh.stream(line, out, stdin=payload, tethered=True)
    except KeyboardInterrupt as exc:
        return _interrupted(exc, ssh, python, remote_dir, local_dir, shown, record, dry, out)
    if status == SSH_FAILED:
        raise failure(host, err)
    sys.stderr.write(err)
    if status != 0 and fresh and not dry and _job_id(ssh, python, remote_dir) is None:
        (local_dir / handles.FILE).unlink(missing_ok=True)  # nothing was submitted
    if status != 0 or dry:
        return Sent(status, err)
    job = _job_id(ssh, python, remote_dir)
    handles.write(local_dir, dataclasses.replace(record, job_id=job))
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


def _target(overrides: list[str], multirun: bool, previous: handles.Handle | None,
            script_args: Sequence[str] = ()) -> _Target:
    """A new run's target from its config, composed and checked here; a resume's from its
    handle (the run's own host, interpreter and code: its config is on the cluster, where
    the resume merges these overrides into it and checks them)."""
    if previous is not None:
        return _Target(previous.host, previous.python, previous.ssh_config,
                       previous.root or DEFAULT_ROOT, None, tuple(previous.secrets))
    # deferred: the typed schemas; hpc_ddp.config.secrets
    from hpc_ddp.config.secrets import referenced
    from hpc_ddp.planning import composed
    from hpc_ddp.remote import trust  # deferred (start-up): remote.trust

    # The config pipeline's first half (hpc_ddp/planning.py): the rest runs on the login
    # node, where the cluster, the run dir and the code are.
    _, (cfg,) = composed([_first_point(overrides) if multirun else overrides])
    python = remote_python(cfg.cluster.python, cfg.cluster.venv)
    trust.python_path(python[0], "cluster.python" if cfg.cluster.python else "cluster.venv")
    if cfg.cluster.ssh_config:
        trust.ssh_config(cfg.cluster.ssh_config)
    return _Target(trust.destination(cfg.cluster.remote or ""), python,
                   cfg.cluster.ssh_config, cfg.cluster.remote_root or DEFAULT_ROOT,
                   cfg.cluster.remote_code,
                   tuple(sorted({*referenced(cfg), *env_names(overrides, script_args,
                                                              cfg.config_dir)})))


def env_names(overrides: Sequence[str], script_args: Sequence[str],
              config_dir: str | None) -> set[str]:
    """Every variable a ``${oc.env:NAME}`` reads in the command line (each point of a sweep,
    a script's arguments: a secret typed there is one by now, submit.py) and in the config
    folder: the login node's shell does not have the laptop's environment, so each is sent
    with the arguments (on standard input), as a secret's value is."""
    # deferred (start-up): config.secret_channels
    from hpc_ddp.config.secret_channels import REFERENCE

    texts = [*overrides, *script_args]
    if config_dir and Path(config_dir).is_dir():
        texts += [p.read_text(errors="replace") for p in sorted(Path(config_dir).rglob("*.yaml"))
                  if p.is_file()]
    return {m.group(1) for text in texts for m in REFERENCE.finditer(text)}


def remote_python(python: str | None, venv: str | None) -> list[str]:
    """The interpreter hpc_ddp runs with on the login node: cluster.python, else
    cluster.venv's, else the login shell's python3."""
    if python:
        return [python]
    if venv:
        return [f"{venv.rstrip('/')}/bin/python"]
    return ["python3"]


def _resumed(overrides: Sequence[str], cwd: Path) -> handles.Handle | None:
    run_dir = text(overrides, "run_dir") if flag(overrides, "resume") else None
    if run_dir:
        return handles.read(cwd / Path(run_dir).expanduser())
    return None


def _first_point(overrides: Sequence[str]) -> list[str]:
    """A sweep's first point, for what every point shares (cluster.remote and its kin)."""
    from hpc_ddp.sweep.expand import first_point  # deferred: the typed schemas

    return first_point(overrides)


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
    asked = text(args, key)
    if previous is not None and asked:
        return previous.remote_dir, Path(asked)
    if asked and not Path(asked).is_absolute():
        return f"{root.rstrip('/')}/runs/{asked}", Path(asked)
    if asked:
        return asked, Path("outputs") / "remote" / stamp
    return f"{root.rstrip('/')}/runs/{stamp}", Path("outputs") / stamp


def _probe(ssh: Ssh, python: list[str], root: str, digest: str, code: Snapshot | None,
           out: TextIO) -> str:
    """One round trip: hpc_ddp there and its version; the remote root's chain to the
    snapshot made and checked there (hpc_ddp/remote/place.py: ours, writable by no one else,
    no link); then the archive if the snapshot is not there whole. Returns the home folder
    there; raises UserError with the fix."""
    place = [*python, "-P", "-m", "hpc_ddp.remote.place"]
    check = (f"{shell_words(python)} -c 'import hpc_ddp; print(hpc_ddp.__version__)' "
             f"|| echo missing; {shell_words([*place, 'check', root, digest])} || true")
    asked = ssh.run(check, timeout=120)
    said = asked.stdout
    lines = said.decode(errors="replace").splitlines()
    version = lines[0].strip() if lines else "missing"
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
    from hpc_ddp.remote.place import answer  # deferred: tarfile

    found = answer(said)  # a refusal there (a folder not ours, a link) raised here
    if "home" not in found:
        raise UserError("cluster.remote_root", root, f"could not be checked there "
                        f"({_last(asked.stderr)}).", "check that the folder can be made there.")
    if found.get("present"):
        return str(found["home"])
    if code is None:  # a resume runs the copy its run recorded, which must be there whole
        raise UserError("snapshot", digest, f"the run's code is no longer whole on "
                        f"{ssh.destination} ({root}/code/{digest}).",
                        "submit the run again from the project (a new snapshot).")
    print(f"hpc_ddp: copying the code ({len(code.archive) // 1024} KiB) to {ssh.destination} "
          "...", file=out, flush=True)
    done = ssh.run(shell_words([*place, "unpack", root, digest]), stdin=code.archive,
                   timeout=600)
    if not answer(done.stdout).get("present"):
        raise UserError("cluster.remote_root", root, "the code could not be unpacked there "
                        f"({_last(done.stderr)}).", "set cluster.remote_root= to a folder of "
                        "yours on the cluster with room for it.")
    return str(found["home"])


def _last(stderr: bytes) -> str:
    lines = stderr.decode(errors="replace").strip().splitlines()
    return lines[-1] if lines else "no message"


def _job_id(ssh: Ssh, python: list[str], remote_dir: str) -> str | None:
    """The job the run dir's job.json names, read there only when the run dir and the file
    are ours (a job.json planted in a folder someone else made says nothing was submitted)."""
    from hpc_ddp.remote.place import answer  # deferred: tarfile

    done = ssh.run(shell_words([*python, "-P", "-m", "hpc_ddp.remote.place", "job",
                                remote_dir]), timeout=60)
    try:
        found = answer(done.stdout).get("job_id")
    except UserError:
        return None
    return str(found) if found else None


def _interrupted(exc: KeyboardInterrupt, ssh: Ssh, python: list[str], remote_dir: str,
                 local_dir: Path, shown: Path, record: handles.Handle, dry: bool,
                 out: TextIO) -> Sent:
    """Ctrl-C (or SIGTERM) while the submit ran there: whether a job went out decides what
    is said (the submit there ended with the connection); a job that did goes on."""
    from hpc_ddp.launch.interrupts import exit_code, name  # deferred (start-up): interrupts

    try:
        job = None if dry else _job_id(ssh, python, remote_dir)
    except (UserError, OSError, subprocess.SubprocessError):
        job = None
        print(f"\nstopped ({name(exc)}); {ssh.destination} could not be asked whether the job "
              f"went out: python -m hpc_ddp.status {shlex.quote(str(shown))}", file=out)
        return Sent(exit_code(exc), "", local_dir)
    if job is None:
        (local_dir / handles.FILE).unlink(missing_ok=True)
        print(f"\nstopped ({name(exc)}) before anything was submitted: nothing runs.",
              file=out)
        return Sent(exit_code(exc))
    handles.write(local_dir, dataclasses.replace(record, job_id=job))
    print(f"\nstopped following; job {job} goes on on {ssh.destination} (python -m "
          f"hpc_ddp.status {shlex.quote(str(shown))} --watch; --cancel stops it).", file=out)
    return Sent(exit_code(exc), "", local_dir)
