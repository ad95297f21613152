"""Start, find and stop the cluster's daemons, always through pid files.

Recipe (docs/testcluster.md, "Why it is set up this way"): start order munged -> MariaDB
-> slurmdbd -> slurmctld -> slurmd x N; tear down by pid files, never by process name.
munged and MariaDB may belong to the machine: we stop them only when we started them, which a
pid file in our state folder records.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from hpc_ddp.testcluster.config import ClusterConfig

# What /proc/<pid>/comm says for each daemon: a pid file whose pid now belongs to another
# program (pid reuse after a crash) is treated as stale, never signalled.
COMM = {"munged": "munged", "mariadb": "mariadbd", "slurmdbd": "slurmdbd", "slurmctld": "slurmctld"}
MARIADB_PID_FILE = Path("/run/mysqld/mysqld.pid")
MUNGED_PID_FILE = Path("/run/munge/munged.pid")


class DaemonError(RuntimeError):
    """A daemon did not start or did not answer in time."""


# --- pids ------------------------------------------------------------------------------------
def read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _comm(daemon: str) -> str:
    return COMM.get(daemon, "slurmd" if daemon.startswith("slurmd-") else daemon)


def pid_alive(pid: int, comm: str | None = None) -> bool:
    """True when ``pid`` runs (not a zombie) and, if given, is the program ``comm``."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        name = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return False
    state = stat.rsplit(")", 1)[1].split()[0]
    return state not in ("Z", "X") and (comm is None or name == comm)


def daemon_pid(cfg: ClusterConfig, daemon: str) -> int | None:
    """The live pid recorded for ``daemon`` in our state folder, else None."""
    pid = read_pid(cfg.pid_file(daemon))
    return pid if pid is not None and pid_alive(pid, _comm(daemon)) else None


def stop_pids(procs: Mapping[int, str | None], timeout: float = 20.0) -> None:
    """SIGTERM every ``pid -> comm`` at once, wait up to ``timeout`` s, then SIGKILL the rest.

    All at once, so that a teardown with N nodes and running jobs costs one wait, not N.
    """

    def alive() -> list[int]:
        return [pid for pid, comm in procs.items() if pid_alive(pid, comm)]

    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
        pids = alive()
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if pids:
            try:
                wait_until(lambda: not alive(), wait, f"pids {pids} to exit", every=0.1)
                return
            except DaemonError:
                if sig == signal.SIGKILL:
                    raise


def stop_daemons(cfg: ClusterConfig, names: list[str], timeout: float = 20.0) -> list[str]:
    """Stop daemons by their pid files and remove the files; returns those that were running."""
    pids = {name: daemon_pid(cfg, name) for name in names}
    stop_pids({pid: _comm(name) for name, pid in pids.items() if pid is not None}, timeout)
    for name in names:
        cfg.pid_file(name).unlink(missing_ok=True)
    return [name for name, pid in pids.items() if pid is not None]


# --- helpers ---------------------------------------------------------------------------------
def wait_until(ok: Callable[[], bool], timeout: float, what: str, every: float = 0.25) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            raise DaemonError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(every)


def run(
    cmd: list[str], env: Mapping[str, str] | None = None, timeout: float = 60.0
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd,
        env=dict(env) if env is not None else None,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def launch(cmd: list[str], env: Mapping[str, str], out: Path) -> None:
    """Run a self-daemonizing launcher; its early stdout/stderr go to ``out``."""
    with out.open("ab") as fh:
        proc = subprocess.run(
            cmd, env=dict(env), stdin=subprocess.DEVNULL, stdout=fh, stderr=fh, timeout=60
        )
    if proc.returncode != 0:
        raise DaemonError(f"`{' '.join(cmd)}` exited with {proc.returncode}; see {out}")


def wait_for_pid(cfg: ClusterConfig, daemon: str, timeout: float = 30.0) -> int:
    wait_until(lambda: daemon_pid(cfg, daemon) is not None, timeout, f"{daemon} to start")
    pid = daemon_pid(cfg, daemon)
    assert pid is not None
    return pid


# --- munge -----------------------------------------------------------------------------------
def munge_works() -> bool:
    """Recipe: ``munge -n | unmunge`` must print STATUS: Success."""
    try:
        cred = run(["munge", "-n"], timeout=10)
        if cred.returncode != 0:
            return False
        check = subprocess.run(
            ["unmunge"], input=cred.stdout, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return check.returncode == 0 and "Success" in check.stdout


def ensure_munged(cfg: ClusterConfig) -> str:
    """Reuse a working munged, else start one as user munge and record its pid as ours."""
    if munge_works():
        return "reused"
    key = Path("/etc/munge/munge.key")
    if not key.exists():
        subprocess.run(["mungekey", "-c", "-k", str(key)], check=True)
        subprocess.run(["chown", "munge:munge", str(key)], check=True)
        key.chmod(0o400)
    for d in (Path("/run/munge"), Path("/var/log/munge"), Path("/var/lib/munge")):
        d.mkdir(parents=True, exist_ok=True)
        subprocess.run(["chown", "munge:munge", str(d)], check=True)
    # --force: an earlier munged that died leaves its socket behind.
    cmd = ["runuser", "-u", "munge", "--", "munged", "--force"]
    launch(cmd, os.environ, cfg.log_dir / "munged.out")
    wait_until(munge_works, 20, "munged to answer `munge -n | unmunge`")
    pid = read_pid(MUNGED_PID_FILE)
    if pid is not None:
        cfg.pid_file("munged").write_text(f"{pid}\n")
    return "started"


# --- MariaDB ---------------------------------------------------------------------------------
def mariadb_alive() -> bool:
    try:
        return run(["mariadb-admin", "--connect-timeout=2", "ping"], timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def ensure_mariadb(cfg: ClusterConfig) -> str:
    """Reuse a running MariaDB (the system datadir), else start one and record it as ours."""
    if mariadb_alive():
        return "reused"
    run_dir = Path("/run/mysqld")
    run_dir.mkdir(parents=True, exist_ok=True)
    log_dir = cfg.state_dir / "mariadb"
    log_dir.mkdir(parents=True, exist_ok=True)
    for d in (run_dir, log_dir):
        subprocess.run(["chown", "mysql:mysql", str(d)], check=True)
    # setsid -f: mariadbd does not fork by itself; this detaches it from us so that it is
    # reparented to init (no zombie in our process when we stop it later).
    cmd = ["setsid", "-f", "mariadbd", "--user=mysql", f"--log-error={log_dir / 'mariadb.log'}"]
    launch(cmd, os.environ, cfg.log_dir / "mariadb.out")
    wait_until(mariadb_alive, 60, "MariaDB to answer `mariadb-admin ping`")
    pid = read_pid(MARIADB_PID_FILE)
    if pid is not None:
        cfg.pid_file("mariadb").write_text(f"{pid}\n")
    return "started"


def reset_database(cfg: ClusterConfig) -> None:
    """Drop and recreate the accounting database, so job ids and sacct start clean.

    Recipe: with a wiped StateSaveLocation job ids restart at 1, and an old database would
    report earlier jobs under the same ids.
    """
    db, user, pw = cfg.db_name, cfg.db_user, cfg.db_password
    sql = (
        f"DROP DATABASE IF EXISTS `{db}`; CREATE DATABASE `{db}`; "
        f"CREATE USER IF NOT EXISTS '{user}'@'localhost' IDENTIFIED BY '{pw}'; "
        f"ALTER USER '{user}'@'localhost' IDENTIFIED BY '{pw}'; "
        f"GRANT ALL ON `{db}`.* TO '{user}'@'localhost'; FLUSH PRIVILEGES;"
    )
    proc = run(["mariadb", "-u", "root", "-e", sql])
    if proc.returncode != 0:
        raise DaemonError(f"creating database {db} failed: {proc.stderr.strip()}")


# --- Slurm -----------------------------------------------------------------------------------
def start_slurmdbd(cfg: ClusterConfig, env: Mapping[str, str]) -> None:
    launch(["slurmdbd"], env, cfg.log_dir / "slurmdbd.out")
    wait_for_pid(cfg, "slurmdbd")
    # Answering sacctmgr means it has connected to MariaDB and created its tables.
    wait_until(
        lambda: run(["sacctmgr", "-n", "-P", "list", "cluster"], env, 30).returncode == 0,
        60,
        "slurmdbd to answer `sacctmgr list cluster`",
        every=0.5,
    )


def add_cluster(cfg: ClusterConfig, env: Mapping[str, str]) -> None:
    proc = run(["sacctmgr", "-i", "add", "cluster", cfg.cluster_name], env)
    if proc.returncode != 0 and "already exists" not in proc.stdout + proc.stderr:
        raise DaemonError(f"sacctmgr add cluster failed: {proc.stdout}{proc.stderr}")


def start_slurmctld(cfg: ClusterConfig, env: Mapping[str, str]) -> None:
    launch(["slurmctld"], env, cfg.log_dir / "slurmctld.out")
    wait_for_pid(cfg, "slurmctld")


def start_slurmd(cfg: ClusterConfig, node: str, netns: Path, env: Mapping[str, str]) -> None:
    """slurmd inside the node's netns, with the node's own hostname.

    Recipe: ``nsenter --net=`` rather than ``ip netns exec``, which remounts /sys so that
    /sys/fs/cgroup vanishes and slurmd dies with "Unable to initialize cgroup plugin";
    ``unshare --uts`` gives the node its own hostname, which job steps then see.
    """
    script = 'hostname "$1" && exec slurmd -N "$1"'
    cmd = ["nsenter", f"--net={netns}", "unshare", "--uts", "--", "sh", "-c", script, "sh", node]
    launch(cmd, env, cfg.log_dir / f"slurmd-{node}.out")


def kill_pids(pids: list[int]) -> None:
    """Stop leftover processes (job steps, slurmstepd) found inside the nodes' namespaces."""
    # Short grace: these are jobs of a cluster being torn down (KillWait=5 in slurm.conf).
    stop_pids({pid: None for pid in pids if pid != os.getpid()}, timeout=3.0)
