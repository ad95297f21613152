"""The test cluster's login node: a network namespace on the cluster's bridge with its own
address, running Debian's OpenSSH server with host and user keys made here.

Recipe (docs/testcluster.md has the cluster's): sshd in ``ip netns exec`` under its own UTS
namespace (hostname ``login``), a config of its own
(its host key, an authorized_keys file of ours, no passwords, no PAM), and
``SetEnv SLURM_CONF=...`` so that sbatch and squeue in an SSH session reach the cluster. The
client side gets an ssh_config file (``-F``) with the alias ``login``, our identity and a
known_hosts file holding the host key, so nothing of the user's own ~/.ssh is read or
written. Used by tests/cluster/test_remote.py; ``down`` removes all of it.
"""

from __future__ import annotations

import ipaddress
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from hpc_ddp.testcluster.config import ClusterConfig

NAME = "login"
HOST_NUMBER = 200  # 10.77.0.200 in the default subnet
SSHD = Path("/usr/sbin/sshd")


def missing() -> str | None:
    """What this machine lacks to run a login node, or None."""
    for program in (str(SSHD), "ssh", "ssh-keygen"):
        if shutil.which(program) is None:
            return f"{program} is not installed (apt-get install openssh-server openssh-client)"
    return None


@dataclass
class LoginNode:
    cluster: ClusterConfig
    folder: Path           # keys, configs, the sshd's log
    slurm_conf: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return str(ipaddress.ip_network(self.cluster.subnet).network_address + HOST_NUMBER)

    @property
    def ssh_config(self) -> Path:
        return self.folder / "ssh_config"

    def _ip(self, *args: str, check: bool = True) -> None:
        subprocess.run(["ip", *args], check=check, capture_output=True)

    def up(self) -> None:
        self.down()
        self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        for key in ("host_key", "user_key"):
            (self.folder / key).unlink(missing_ok=True)
            (self.folder / f"{key}.pub").unlink(missing_ok=True)
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", key, "-f",
                            str(self.folder / key)], check=True, capture_output=True)
        shutil.copy(self.folder / "user_key.pub", self.folder / "authorized_keys")
        host_pub = (self.folder / "host_key.pub").read_text().split()
        (self.folder / "known_hosts").write_text(
            f"{NAME},{self.address} {host_pub[0]} {host_pub[1]}\n")
        self.ssh_config.write_text(self.client_config(NAME, self.folder / "user_key"))
        (self.folder / "sshd_config").write_text(
            f"ListenAddress {self.address}\nHostKey {self.folder / 'host_key'}\n"
            f"AuthorizedKeysFile {self.folder / 'authorized_keys'}\n"
            "PermitRootLogin prohibit-password\nPasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
            f"PidFile {self.folder / 'sshd.pid'}\nSetEnv SLURM_CONF={self.slurm_conf}\n"
            "MaxSessions 50\nMaxStartups 50\n")
        ns, veth = self.cluster.netns(NAME), self.cluster.host_veth(NAME)
        self._ip("netns", "add", ns)
        self._ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        self._ip("link", "set", veth, "master", self.cluster.bridge, "up")
        self._ip("-n", ns, "addr", "add", f"{self.address}/{self.cluster.prefix_len}",
                 "dev", "eth0")
        self.link(True)
        self._ip("-n", ns, "link", "set", "lo", "up")
        Path("/run/sshd").mkdir(exist_ok=True)
        log = (self.folder / "sshd.log").open("ab")
        self.process = subprocess.Popen(
            ["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c",
             f"hostname {NAME} && exec {SSHD} -D -e -f {self.folder / 'sshd_config'}"],
            stdout=log, stderr=log, start_new_session=True)
        # An earlier login node's link layer address may still be cached for this address.
        self._ip("neigh", "flush", "to", self.address, check=False)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                done = subprocess.run(["ssh", "-F", str(self.ssh_config), "-o", "BatchMode=yes",
                                       "-o", "ConnectTimeout=3", NAME, "true"],
                                      capture_output=True, timeout=10)
                if done.returncode == 0:
                    return
            except subprocess.TimeoutExpired:
                pass
            time.sleep(0.2)
        raise RuntimeError("the login node's sshd did not answer: "
                           + (self.folder / "sshd.log").read_text()[-2000:])

    def client_config(self, alias: str, identity: Path, known_hosts: Path | None = None) -> str:
        """An ssh_config for the login node under ``alias``, with ``identity`` and a
        known_hosts file (default: the one holding its key)."""
        known = known_hosts or self.folder / "known_hosts"
        return (f"Host {alias}\n  HostName {self.address}\n  User root\n"
                f"  IdentityFile {identity}\n  IdentitiesOnly yes\n"
                f"  UserKnownHostsFile {known}\n  StrictHostKeyChecking yes\n"
                "  LogLevel ERROR\n")

    def link(self, up: bool) -> None:
        """The login node's network link up or down (a dropped connection)."""
        self._ip("-n", self.cluster.netns(NAME), "link", "set", "eth0",
                 "up" if up else "down")

    def down(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.process = None
        ns = self.cluster.netns(NAME)
        if Path(f"/run/netns/{ns}").exists():  # its sessions' processes, ended with it
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                                  text=True).stdout.split()
            for pid in pids:
                subprocess.run(["kill", "-KILL", pid], capture_output=True)
        self._ip("link", "del", self.cluster.host_veth(NAME), check=False)
        self._ip("netns", "del", self.cluster.netns(NAME), check=False)
