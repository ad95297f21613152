"""What the laptop takes from a handle or a config before it runs anything with it.

A handle (``remote.json``) may sit in a project folder a group shares; :func:`hpc_ddp.remote.
handle.read` reads it only when it is ours (hpc_ddp/owned.py). Its fields are then data of
the shapes hpc_ddp writes, checked here: the interpreter is one path to a ``python``, the
host a destination (never an ssh option), the secrets' names environment variable names, the
ssh_config a file only we (or root) can write: an ``ssh_config`` is a program too
(``ProxyCommand``, ``LocalCommand``, ``Match exec`` run commands), and OpenSSH checks the
owner and mode of ``~/.ssh/config`` but not of a file given with ``-F``
(https://man.openbsd.org/ssh_config#FILES).
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING

from hpc_ddp.errors import UserError
from hpc_ddp.owned import who

if TYPE_CHECKING:
    from hpc_ddp.remote.handle import Handle

_PYTHON = re.compile(r"^[A-Za-z0-9_./~+-]+$")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_JOB = re.compile(r"^[0-9]+(_[0-9]+)?$")
_DIGEST = re.compile(r"^[0-9a-f]{0,64}$")


def destination(host: str) -> str:
    """An SSH destination as typed after ``ssh`` (hpc_ddp/remote/ssh.py's rule: never an
    option such as ``-oProxyCommand=...``, no space or control character)."""
    from hpc_ddp.remote.ssh import destination_problem  # deferred (start-up): remote.ssh

    problem = destination_problem(host)
    if problem is not None:
        raise problem
    return host


def python_path(python: str, key: str = "cluster.python") -> str:
    """The interpreter there: one path (or name) of a ``python`` program, nothing a shell or
    ssh would read as more than that."""
    name = Path(python).name
    if not _PYTHON.match(python) or python.startswith("-") or not name.startswith("python"):
        raise UserError(key, python, "is not a path to a python interpreter.",
                        "name the interpreter on the login node, e.g. "
                        "cluster.python=/shared/envs/train/bin/python, or set cluster.venv=.")
    return python


def ssh_config(path: str, key: str = "cluster.ssh_config") -> str:
    """An ssh_config file that is ours or root's, a regular file, writable by no one else
    (it names the commands ssh runs)."""
    try:
        info = os.stat(Path(path).expanduser())
    except OSError as exc:
        raise UserError(key, path, f"cannot be read ({exc.strerror}).",
                        "name an ssh_config file of yours, or leave it unset "
                        "(~/.ssh/config).") from None
    me = os.geteuid()
    if not stat.S_ISREG(info.st_mode):
        raise UserError(key, path, "is not a file.", "name an ssh_config file of yours.")
    if info.st_uid not in (me, 0):
        raise UserError(key, path, f"belongs to {who(info.st_uid)}, not to you: an ssh "
                        "config runs the commands it names (ProxyCommand) as you.",
                        "use a copy of your own (cp it, then chmod 600), after reading it.")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UserError(key, path, f"is writable by others (mode "
                        f"{stat.S_IMODE(info.st_mode):o}): anyone who can write it can make "
                        "ssh run a command as you.", f"chmod go-w {path}")
    return path


def checked(handle: Handle, folder: Path) -> Handle:
    """``handle`` (read from ``folder``) when every field has the shape hpc_ddp writes;
    UserError naming the field otherwise."""
    def bad(name: str, why: str) -> UserError:
        return UserError("run_dir", str(folder), f"its remote.json has a {name} that hpc_ddp "
                         f"never writes ({why}); nothing was run.",
                         "submit again from a folder of your own, or remove the folder.")

    for f in fields(handle):
        value = getattr(handle, f.name)
        if f.name == "python" and not (isinstance(value, list) and len(value) == 1
                                       and isinstance(value[0], str)):
            raise bad("python", "not one interpreter")
        if f.name == "secrets" and not (isinstance(value, list) and all(
                isinstance(v, str) and _NAME.match(v) for v in value)):
            raise bad("secrets", "not a list of variable names")
        if f.name in ("host", "remote_dir", "snapshot") and not isinstance(value, str):
            raise bad(f.name, "not text")
        if f.name in ("ssh_config", "job_id", "root") and value is not None and not (
                isinstance(value, str) and "\n" not in value and "\0" not in value):
            raise bad(f.name, "not text")
    if not isinstance(handle.sweep, bool):
        raise bad("sweep", "not true or false")
    if not _DIGEST.match(handle.snapshot) or "\n" in handle.remote_dir:
        raise bad("snapshot or remote_dir", "not a digest and a path")
    if handle.job_id is not None and not _JOB.match(handle.job_id):
        raise bad("job_id", "not a job id")
    try:
        destination(handle.host)
        python_path(handle.python[0])
        if handle.ssh_config is not None:
            ssh_config(handle.ssh_config)
    except UserError as exc:
        raise UserError("run_dir", str(folder), f"its remote.json is refused: {exc.key}="
                        f"{exc.value}: {exc.problem}", exc.fix) from None
    return handle
