"""The local handle of a remote run, and ``status``/``logs`` forwarded through it.

A handle is a small local run dir holding ``remote.json``: the host, the run dir there, the
snapshot it runs, the interpreter, the job. ``python -m hpc_ddp.status|logs HANDLE ...``
runs the same command on the login node, on the remote run dir, over one SSH connection,
its output here as it comes. A connection that drops under ``--follow``/``--watch`` never
touches the run: the command says so, connects again and goes on (``logs --follow`` from
the last line it printed, not from the start).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TextIO

from hpc_ddp.errors import USAGE_EXIT_CODE, UserError
from hpc_ddp.owned import Untrusted, check_folder, read_owned
from hpc_ddp.remote.ssh import SSH_FAILED, Ssh, command_line, control_dir, failure

FILE = "remote.json"
RECONNECT_S = 3.0
# A log line's time, as ranklog writes it: "2026-12-04 20:04:05.497 [rank 0 ...] ..."
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d):\d\d\.\d+ ")


@dataclass(frozen=True)
class Handle:
    host: str
    remote_dir: str
    snapshot: str
    python: list[str]
    ssh_config: str | None = None
    job_id: str | None = None
    sweep: bool = False
    root: str | None = None  # cluster.remote_root there, absolute: its code/ and runs/
    secrets: list[str] = field(default_factory=list)  # names of the env values a resume sends


def write(folder: Path, handle: Handle) -> None:
    """``remote.json`` in ``folder`` (made 0750 when missing): a folder that is not this
    user's, or that others can write, is refused first (its handle would not be read back)."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o750)

    try:
        check_folder(folder)
    except Untrusted as exc:
        raise UserError("run_dir", str(folder), str(exc), "") from None
    tmp = folder / f".{FILE}.tmp"
    tmp.unlink(missing_ok=True)  # never written through a link left there
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o640)
    with os.fdopen(fd, "w") as stream:
        stream.write(json.dumps(asdict(handle), indent=2) + "\n")
    os.replace(tmp, folder / FILE)


def read(folder: Path) -> Handle | None:
    """The handle in ``folder``, or None when it is not one. A handle is read only when the
    folder and the file are this user's, writable by no one else and no link (as every run-dir
    file that can run code: hpc_ddp/owned.py), and its fields are data of the shapes hpc_ddp
    writes (:func:`hpc_ddp.remote.trust.checked`): none of them can name a program to run."""
    path = folder / FILE
    if not (path.is_file() or path.is_symlink()):
        return None
    # deferred (start-up): remote.trust
    from hpc_ddp.remote.trust import checked

    try:
        data = json.loads(read_owned(path, folder))
        record = Handle(**{k: data[k] for k in Handle.__dataclass_fields__ if k in data})
    except Untrusted as exc:
        problem, _, fix = str(exc).partition(" Fix: ")
        raise UserError("run_dir", str(folder), f"its {FILE} is not to be trusted: {problem}",
                        fix or "submit again from a folder of your own.") from None
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise UserError("run_dir", str(folder), f"its {FILE} cannot be read ({exc}).",
                        "submit again, or remove the folder if the run is gone.") from None
    return checked(record, folder)


def forwarded(module: str, argv: Sequence[str], out: TextIO) -> int | None:
    """:func:`forward` as a command ends: its exit code, bad input as one line (exit 2), a
    Ctrl-C as 130 (the run goes on there); None when argv names no handle."""
    try:
        return forward(module, argv, out)
    except UserError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return USAGE_EXIT_CODE
    except KeyboardInterrupt:
        return 130


def forward(module: str, argv: Sequence[str], out: TextIO = sys.stdout,
            environ: Mapping[str, str] = os.environ) -> int | None:
    """Run ``python -m hpc_ddp.<module> argv`` where the run is when argv's first path is a
    handle (None when it is not: the command goes on here)."""
    args = list(argv)
    at = next((i for i, a in enumerate(args)
               if not a.startswith("-") and (Path(a) / FILE).is_file()), None)
    if at is None or (handle := read(Path(args[at]))) is None:
        return None
    args[at] = handle.remote_dir
    ssh = Ssh(handle.host, control_dir(environ), handle.ssh_config)
    following = any(a in ("--follow", "-f", "--watch") for a in args)
    if module == "logs" and following:
        return _follow_logs(ssh, handle, args, out)
    line = command_line(_held(handle, module, args))
    while True:
        code, err = ssh.stream(line, out, shown=_here(handle, str(argv[at])),
                               tethered=True)
        if code != SSH_FAILED:
            sys.stderr.write(err)
            return code
        if not following:
            raise failure(handle.host, err)
        _lost(handle.host, out)


def _lost(host: str, out: TextIO) -> None:
    print(f"hpc_ddp: the connection to {host} was lost (the run goes on there); "
          f"connecting again in {RECONNECT_S:.0f} s ...", file=out, flush=True)
    time.sleep(RECONNECT_S)


def _follow_logs(ssh: Ssh, handle: Handle, args: list[str], out: TextIO) -> int:
    """``logs --follow`` line by line; after a lost connection, again from the minute of the
    last line printed, the lines already printed skipped."""
    seen: set[str] = set()
    minute: str | None = None
    reconnected = False

    def shown(text: str) -> str | None:
        nonlocal minute, seen, reconnected
        stamp = _STAMP.match(text)
        if stamp:
            if text in seen:
                return None
            if stamp.group(1) != minute:
                minute, seen = stamp.group(1), set()
            seen.add(text)
        if reconnected:
            reconnected = False
            return f"hpc_ddp: reconnected to {handle.host}; going on.\n{text}"
        return text

    while True:
        extra = ["--since", minute] if minute else []
        line = command_line(_held(handle, "logs", [*args, *extra]))
        code, err = ssh.stream(line, out, shown=shown, tethered=True)
        if code != SSH_FAILED:
            sys.stderr.write(err)
            return code
        _lost(handle.host, out)
        reconnected = True


def _held(handle: Handle, module: str, args: Sequence[str]) -> list[str]:
    """``python -P -m hpc_ddp.remote.tether hpc_ddp.<module> args``: the command there ends
    when this connection does (hpc_ddp/remote/tether.py)."""
    return [*handle.python, "-P", "-m", "hpc_ddp.remote.tether", f"hpc_ddp.{module}", *args]


def _here(handle: Handle, local: str) -> Callable[[str], str]:
    """Each forwarded line with the run dir there as the handle here (``local``, as typed):
    the resume line that ``--stop``/``--cancel`` print, and every other path to the run,
    work on this machine."""
    there, here = handle.remote_dir.rstrip("/"), local.rstrip("/") or local
    pairs = [(shlex.quote(there), shlex.quote(here)), (there, here)]

    def shown(text: str) -> str:
        for old, new in pairs:
            text = text.replace(old, new)
        return text

    return shown
