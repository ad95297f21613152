"""The connection to the cluster's login node: OpenSSH's own client, as the user set it up.

The destination is what the user types after ``ssh`` (``alice@login.example.org`` or an
alias of ``~/.ssh/config`` with its ProxyJump, port, identity and agent): we add only

- ``BatchMode=yes``: never a prompt (a password, a passphrase, an unknown host key); what
  would have asked fails at once and :func:`failure` says it in one line with the fix.
- ``ControlMaster=auto``, ``ControlPath``, ``ControlPersist``: every command of a submit, a
  ``status --watch`` or a ``logs --follow`` goes over one connection (the first costs the
  handshake, each later one ~0.15 s here). The socket lives in a folder of ours, mode 0700.
  https://man.openbsd.org/ssh_config#ControlMaster
- ``ConnectTimeout``, ``ServerAliveInterval``/``ServerAliveCountMax``: a host that does not
  answer, or a link that dies under a follow, ends the command within seconds (exit 255).

The remote command is one shell line (OpenSSH joins its arguments for the remote shell);
every word of it is quoted here. Nothing secret is ever part of it: the config and secrets
travel on the connection's standard input (hpc_ddp/remote/submit_remote.py).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TextIO

from hpc_ddp.errors import UserError

# ssh's own exit status for its failures (anything else is the remote command's).
SSH_FAILED = 255
CONNECT_TIMEOUT_S = 10
ALIVE_INTERVAL_S = 5
ALIVE_COUNT = 3
PERSIST_S = 60


def control_dir(environ: Mapping[str, str]) -> Path:
    """Our folder for the multiplexing sockets: short (a socket path must stay under ~100
    bytes; ``%C`` is a 16-character hash) and this user's alone."""
    runtime = Path(environ.get("XDG_RUNTIME_DIR") or "/nonexistent")
    base = runtime if runtime.is_dir() else Path(tempfile.gettempdir())
    folder = base / f"hpc_ddp-ssh-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    if folder.is_symlink() or folder.stat().st_uid != os.getuid() or (
            folder.stat().st_mode & 0o077):
        raise UserError("ssh", str(folder), "is not a private folder of yours (its sockets "
                        "would let another user run commands as you).",
                        f"remove it (rm -r {shlex.quote(str(folder))}) and try again.")
    return folder


@dataclass(frozen=True)
class Ssh:
    """One SSH destination. ``config``: an ssh_config file to read instead of ~/.ssh/config
    (``cluster.ssh_config``)."""

    destination: str
    sockets: Path
    config: str | None = None

    def options(self) -> list[str]:
        return [*(["-F", self.config] if self.config else []),
                "-o", "BatchMode=yes", "-o", "ControlMaster=auto",
                "-o", f"ControlPath={self.sockets}/%C", "-o", f"ControlPersist={PERSIST_S}",
                "-o", f"ConnectTimeout={CONNECT_TIMEOUT_S}",
                "-o", f"ServerAliveInterval={ALIVE_INTERVAL_S}",
                "-o", f"ServerAliveCountMax={ALIVE_COUNT}"]

    def argv(self, line: str) -> list[str]:
        """The local command that runs shell ``line`` on the login node."""
        return ["ssh", *self.options(), "-T", "--", self.destination, line]

    def run(self, line: str, stdin: bytes | None = None,
            timeout: float = 600) -> subprocess.CompletedProcess[bytes]:
        """Run ``line`` there; raises UserError (one line, the fix) when ssh itself failed."""
        done = subprocess.run(self.argv(line), input=stdin, capture_output=True,
                              timeout=timeout, check=False)
        if done.returncode == SSH_FAILED:
            raise failure(self.destination, done.stderr.decode(errors="replace"))
        return done

    @contextlib.contextmanager
    def opened(self, line: str, stdin: bytes | None = None
               ) -> Iterator[tuple[subprocess.Popen[bytes], IO[bytes]]]:
        """``line`` running there: (the process, its standard output a pipe to read; a file
        that receives its standard error, read with :func:`said` once it has ended). ``stdin``
        is written and closed first."""
        # standard error to a file, not a pipe: a full pipe there would stop the command
        with tempfile.TemporaryFile() as err, subprocess.Popen(
                self.argv(line), stdin=subprocess.PIPE if stdin is not None else None,
                stdout=subprocess.PIPE, stderr=err) as proc:
            if proc.stdin is not None:
                proc.stdin.write(stdin or b"")
                proc.stdin.close()
            yield proc, err

    def stream(self, line: str, out: TextIO, stdin: bytes | None = None,
               shown: Callable[[str], str | None] = lambda text: text) -> tuple[int, str]:
        """Run ``line`` there, its output written to ``out`` as it comes, each line as
        ``shown`` makes it (None: left out): (the exit code, its standard error; ssh's own
        failure is exit SSH_FAILED, see :func:`failure`)."""
        with self.opened(line, stdin) as (proc, err):
            assert proc.stdout is not None
            for raw in proc.stdout:
                text = shown(raw.decode(errors="replace"))
                if text is not None:
                    out.write(text)
                    out.flush()
            return proc.wait(), said(err)

    def close(self) -> None:
        """End the shared connection (the next command opens a new one)."""
        subprocess.run(["ssh", *self.options(), "-O", "exit", "--", self.destination],
                       capture_output=True, timeout=30, check=False)


def said(err: IO[bytes]) -> str:
    """What a command of :meth:`Ssh.opened` wrote to its standard error."""
    err.seek(0)
    return err.read().decode(errors="replace")


def command_line(words: Sequence[str], cwd: str | None = None) -> str:
    """``words`` as one remote shell line, each quoted; ``cwd`` first when given."""
    line = shell_words(words)
    return f"cd {remote_path(cwd)} && {line}" if cwd else line


def shell_words(words: Sequence[str]) -> str:
    """``words`` quoted for the remote shell, the program's leading ``~/`` kept as home."""
    return " ".join([remote_path(words[0]), *map(shlex.quote, words[1:])]) if words else ""


def remote_path(path: str) -> str:
    """A remote path quoted for the remote shell, a leading ``~/`` kept as the home folder
    (the user writes ``cluster.remote_root=~/hpc_ddp``)."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        return '"$HOME"/' + shlex.quote(path[2:])
    return shlex.quote(path)


# What ssh says (OpenSSH 9) -> what it means and the fix, first match wins.
_FAILURES: tuple[tuple[tuple[str, ...], str, str], ...] = (
    (("REMOTE HOST IDENTIFICATION HAS CHANGED",),
     "its host key has changed since you last connected (a reinstalled host, or someone "
     "in between).",
     "if the cluster's admins confirm a new key, remove the old one (ssh-keygen -R HOST) "
     "and connect once with ssh HOST to check the new fingerprint; otherwise do not "
     "connect."),
    (("Host key verification failed", "No ED25519 host key is known",
      "No RSA host key is known", "No ECDSA host key is known"),
     "its host key is not known here, and hpc_ddp never answers ssh's question for you.",
     "connect once with ssh HOST, check the fingerprint against your site's documentation "
     "and accept it; then submit again."),
    (("Permission denied",),
     "it refused every key and method offered (hpc_ddp never types a password or a "
     "passphrase).",
     "check that ssh HOST works without a prompt: ssh-copy-id HOST, or load your key into "
     "the agent (ssh-add); see docs/remote.md."),
    (("Could not resolve hostname", "Name or service not known"),
     "the name does not resolve here.",
     "check the spelling, or add a Host entry with its HostName to ~/.ssh/config."),
    (("Connection timed out", "Operation timed out", "No route to host",
      "Network is unreachable", "Connection refused", "Connection closed by",
      "Connection reset", "timed out"),
     "it does not answer.",
     "check your network (a VPN the cluster needs?) and that ssh HOST works; the run, if "
     "one was started, is not affected."),
)


def failure(destination: str, stderr: str) -> UserError:
    """ssh's own failure (exit 255) in one line with the fix."""
    for needles, meaning, fix in _FAILURES:
        if any(n in stderr for n in needles):
            return UserError("cluster.remote", destination, f"cannot connect: {meaning}",
                             fix.replace("HOST", destination))
    said = " ".join(line.strip() for line in stderr.strip().splitlines()[-2:]) or "no message"
    return UserError("cluster.remote", destination, f"ssh failed ({said}).",
                     f"check that ssh {destination} true works from this shell without a "
                     "prompt.")
