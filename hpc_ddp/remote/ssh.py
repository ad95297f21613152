"""The connection to the cluster's login node: OpenSSH's own client, as the user set it up.

The destination is what the user types after ``ssh`` (``alice@login.example.org`` or an
alias of ``~/.ssh/config`` with its ProxyJump, port, identity and agent): we add only

- ``BatchMode=yes``: never a prompt (a password, a passphrase, an unknown host key); what
  would have asked fails at once and :func:`failure` says it in one line with the fix.
- ``ControlMaster=auto``, ``ControlPath``, ``ControlPersist``: every command of a submit, a
  ``status --watch`` or a ``logs --follow`` goes over one connection (the first costs the
  handshake, each later one ~0.15 s here). The socket lives in a folder of ours, mode 0700
  (:func:`control_dir`), and its name holds a hash of the ``-F`` file as well as ``%C``: a
  master opened under one ssh_config is never reused by a command of another.
  https://man.openbsd.org/ssh_config#ControlMaster
- ``ConnectTimeout``, ``ServerAliveInterval``/``ServerAliveCountMax``: a host that does not
  answer, or a link that dies under a follow, ends the command within seconds (exit 255).

The remote command is one shell line (OpenSSH joins its arguments for the remote shell);
every word of it is quoted here. Nothing secret is ever part of it: the config and secrets
travel on the connection's standard input (hpc_ddp/remote/submit_remote.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shlex
import subprocess
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TextIO

from hpc_ddp.errors import UserError
from hpc_ddp.owned import private

# ssh's own exit status for its failures (anything else is the remote command's).
SSH_FAILED = 255
CONNECT_TIMEOUT_S = 10
ALIVE_INTERVAL_S = 5
ALIVE_COUNT = 3
PERSIST_S = 60

# A socket's path must fit sun_path: 104 bytes with its NUL on macOS and the BSDs (108 on
# Linux). ssh binds a new master at ControlPath + "." + 16 random characters first and then
# renames it (muxserver_listen in
# https://github.com/openssh/openssh-portable/blob/master/mux.c); %C is a SHA-1, 40 hex
# characters (https://man.openbsd.org/ssh_config#ControlPath). Ours: FOLDER/%C-TAG.
SUN_PATH = 104
TAG_CHARS = 8
SOCKET_CHARS = len("/") + 40 + len("-") + TAG_CHARS + len(".") + 16
# /tmp itself, not $TMPDIR: macOS's is ~50 characters, too long for a socket's folder.
TMP = Path("/tmp")


def control_dir(environ: Mapping[str, str], tmp: Path = TMP) -> Path:
    """Our folder for the multiplexing sockets, short enough for a socket's path and this
    user's alone (:func:`private`): the first of $XDG_RUNTIME_DIR/hpc_ddp-ssh, /tmp/hpc_ddp-
    ssh-UID, ~/.ssh/hpc_ddp, else a new folder under /tmp. What another user made (or linked)
    at one of those names is passed over, never used: in sticky /tmp only its owner or root
    could remove it."""
    runtime, home = environ.get("XDG_RUNTIME_DIR"), environ.get("HOME")
    tried = [*([Path(runtime) / "hpc_ddp-ssh"] if runtime else []),
             tmp / f"hpc_ddp-ssh-{os.getuid()}",
             *([Path(home) / ".ssh" / "hpc_ddp"] if home else [])]
    for folder in tried:
        if fits(folder) and private(folder, parent=folder.parent.name == ".ssh"):
            return folder
    return Path(tempfile.mkdtemp(prefix="hpc_ddp-ssh-", dir=tmp))  # 0700, ours, new


def fits(folder: Path) -> bool:
    """Whether a socket of :meth:`Ssh.socket` in ``folder`` fits sun_path, and ssh takes its
    path as it is (it splits an -o value at whitespace and expands its % tokens)."""
    text = str(folder)
    return (len(os.fsencode(text)) + SOCKET_CHARS < SUN_PATH
            and not any(c.isspace() or c in "%\"'" for c in text))


def destination_problem(destination: str) -> UserError | None:
    """Why ``destination`` is refused before any ssh runs (None: it is not): one that starts
    with "-" is an option to ssh (-oProxyCommand=... runs a command here); whitespace and
    control characters have no place in a host's name either."""
    if (destination and not destination.startswith("-") and destination.isprintable()
            and not any(c.isspace() for c in destination)):
        return None
    return UserError("cluster.remote", destination if destination.isprintable()
                     else ascii(destination), "is not an SSH destination (it is empty, starts "
                     "with '-', or holds whitespace or control characters).",
                     "set cluster.remote to the host as you type it after ssh: user@host or "
                     "an alias of ~/.ssh/config.")


@dataclass(frozen=True)
class Ssh:
    """One SSH destination. ``config``: an ssh_config file to read instead of ~/.ssh/config
    (``cluster.ssh_config``)."""

    destination: str
    sockets: Path
    config: str | None = None

    def __post_init__(self) -> None:
        if (problem := destination_problem(self.destination)) is not None:
            raise problem

    def socket(self) -> str:
        """The ControlPath: ``%C`` (the user, host, port and ProxyJump) and a hash of the
        ``-F`` file's path and content, so that a master opened under one ssh_config (a lax
        one, say) is not reused by a command under another while it persists."""
        digest = hashlib.sha256(b"no -F")
        if self.config:
            path = os.path.abspath(self.config)  # as ssh reads it, from this folder
            digest = hashlib.sha256(b"-F\0" + os.fsencode(path) + b"\0")
            with contextlib.suppress(OSError):  # unreadable: ssh itself says so
                digest.update(Path(path).read_bytes())
        return f"{self.sockets}/%C-{digest.hexdigest()[:TAG_CHARS]}"

    def options(self) -> list[str]:
        return [*(["-F", self.config] if self.config else []),
                "-o", "BatchMode=yes", "-o", "ControlMaster=auto",
                "-o", f"ControlPath={self.socket()}", "-o", f"ControlPersist={PERSIST_S}",
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
    def opened(self, line: str, stdin: bytes | None = None, tethered: bool = False
               ) -> Iterator[tuple[subprocess.Popen[bytes], IO[bytes]]]:
        """``line`` running there: (the process, its standard output a pipe to read; a file
        that receives its standard error, read with :func:`said` once it has ended). ``stdin``
        is written and closed first; ``tethered``: written, then kept open with a heartbeat
        for a command there that holds it (hpc_ddp/remote/tether.py), closed at the end."""
        # deferred (start-up): remote.tether
        from hpc_ddp.remote.tether import Heartbeat

        # standard error to a file, not a pipe: a full pipe there would stop the command
        with tempfile.TemporaryFile() as err, subprocess.Popen(
                self.argv(line), stdin=subprocess.PIPE if stdin is not None or tethered
                else None, stdout=subprocess.PIPE, stderr=err) as proc:
            beat = None
            if proc.stdin is not None:
                proc.stdin.write(stdin or b"")
                proc.stdin.flush()
                if tethered:
                    beat = Heartbeat(proc)
                else:
                    proc.stdin.close()
            try:
                yield proc, err
            finally:
                if beat is not None:
                    beat.stop()

    def stream(self, line: str, out: TextIO, stdin: bytes | None = None,
               shown: Callable[[str], str | None] = lambda text: text,
               tethered: bool = False) -> tuple[int, str]:
        """Run ``line`` there, its output written to ``out`` as it comes, each line as
        ``shown`` makes it (None: left out): (the exit code, its standard error; ssh's own
        failure is exit SSH_FAILED, see :func:`failure`). ``tethered``: :meth:`opened`'s."""
        with self.opened(line, stdin, tethered) as (proc, err):
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
    """ssh's own failure (exit 255) in one line with the fix. The destination is quoted in
    the commands the fix suggests: pasted, they run ssh, not what a name could hold."""
    if (problem := destination_problem(destination)) is not None:
        return problem
    host = shlex.quote(destination)
    for needles, meaning, fix in _FAILURES:
        if any(n in stderr for n in needles):
            return UserError("cluster.remote", destination, f"cannot connect: {meaning}",
                             fix.replace("HOST", host))
    said = " ".join(line.strip() for line in stderr.strip().splitlines()[-2:]) or "no message"
    return UserError("cluster.remote", destination, f"ssh failed ({said}).",
                     f"check that ssh {host} true works from this shell without a prompt.")
