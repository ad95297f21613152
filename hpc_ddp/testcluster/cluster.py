"""The test cluster as one object: ``TestCluster(...).up()``, ``.down()``, ``.status()``.

``up`` is idempotent: a healthy cluster with the same configuration is reused; anything else
(stale pid files, leftover namespaces, half-dead daemons) is torn down and started afresh,
with a fresh StateSaveLocation and a fresh accounting database (docs/testcluster.md: job ids
restart at 1 with a wiped state folder, so the database must be wiped with it).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from hpc_ddp.testcluster import daemons, network, settle, shaping, straggler
from hpc_ddp.testcluster.config import (
    MAX_INSTANCES,
    STATE_DIR_ENV,
    ClusterConfig,
    default_state_dir,
    fingerprint,
    instance_settings,
    render_gres_conf,
    render_slurm_conf,
    render_slurmdbd_conf,
    render_task_prolog,
)

APT_INSTALL = (
    "sudo apt-get update && sudo apt-get install -y "
    "slurmctld slurmd slurm-client slurmdbd munge mariadb-server"
)
REQUIRED_BINARIES = (
    "slurmctld",
    "slurmd",
    "slurmdbd",
    "sinfo",
    "srun",
    "sbatch",
    "sacct",
    "sacctmgr",
    "scontrol",
    "munged",
    "munge",
    "unmunge",
    "mariadbd",
    "mariadb",
    "mariadb-admin",
    "ip",
    "tc",
    "nsenter",
    "unshare",
    "runuser",
    "setsid",
)
# Node states (sinfo %t) in which a node can run jobs.
READY_STATES = {"idle", "alloc", "mix", "comp"}


def requirements_missing() -> str | None:
    """Why the cluster cannot start on this machine (with the fix), or None if it can."""
    problems = []
    if os.geteuid() != 0:
        problems.append("needs root (network namespaces, /etc/hosts, daemons): run with sudo")
    missing = [b for b in REQUIRED_BINARIES if shutil.which(b) is None]
    if missing:
        problems.append(f"missing programs {', '.join(missing)}: {APT_INSTALL}")
    return "; ".join(problems) or None


class TestClusterError(RuntimeError):
    """The cluster did not come up; the message carries the daemon logs' tails."""


_LOCK_DEPTH = [0]  # machine_lock is reentrant within a process (flock is per open file)


@contextlib.contextmanager
def machine_lock() -> Iterator[None]:
    """Held while a cluster changes what every cluster on this machine shares (/etc/hosts,
    munged, MariaDB and its users, the fake GPU files): two clusters start side by side in
    the test suite, and each reads and rewrites /etc/hosts."""
    if _LOCK_DEPTH[0]:
        _LOCK_DEPTH[0] += 1
        try:
            yield
        finally:
            _LOCK_DEPTH[0] -= 1
        return
    # In /tmp by default, where anyone can plant a link or a file of theirs: neither is used.
    path = default_state_dir().parent / "hpc_ddp_testcluster.lock"
    fix = f"remove it (or set ${STATE_DIR_ENV} to a folder of yours)"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:  # a link (ELOOP) among them
        raise TestClusterError(f"{path} cannot be the clusters' lock ({exc.strerror}): "
                               f"{fix}.") from None
    if os.fstat(fd).st_uid != os.geteuid():
        os.close(fd)
        raise TestClusterError(f"{path} belongs to another user: {fix}.")
    with os.fdopen(fd, "r+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        _LOCK_DEPTH[0] = 1
        try:
            yield
        finally:
            _LOCK_DEPTH[0] = 0
            fcntl.flock(f, fcntl.LOCK_UN)


class TestCluster:
    """A Slurm cluster of ``nodes`` namespaced nodes on this machine (see docs/testcluster.md)."""

    __test__ = False  # a library class, not a pytest test class despite its name

    def __init__(
        self,
        state_dir: Path | str | None = None,
        nodes: int = 4,
        cpus: int = 2,
        gpus: int = 2,
        *,
        real_memory_mb: int = 3000,
        task_affinity: bool = False,
        instance: int = 0,
        say: Callable[[str], None] | None = None,
    ) -> None:
        kwargs: dict[str, Any] = {
            **instance_settings(instance),
            "nodes": nodes,
            "cpus": cpus,
            "gpus": gpus,
            "real_memory_mb": real_memory_mb,
            "task_affinity": task_affinity,
        }
        if state_dir is not None:
            kwargs["state_dir"] = Path(state_dir)
        self.config = ClusterConfig(**kwargs)
        self._say = say or (lambda msg: None)

    # --- what clients need -------------------------------------------------------------
    @property
    def state_dir(self) -> Path:
        return self.config.state_dir

    @property
    def node_names(self) -> list[str]:
        return self.config.node_names

    @property
    def node_addresses(self) -> dict[str, str]:
        return self.config.node_addresses

    @property
    def partitions(self) -> list[str]:
        return [p.name for p in self.config.partitions]

    def env(self) -> dict[str, str]:
        """Environment variables that point Slurm clients (sinfo, sbatch, submitit) here."""
        return {"SLURM_CONF": str(self.config.slurm_conf)}

    @contextlib.contextmanager
    def node_environment(self, node: str, values: dict[str, str]) -> Iterator[None]:
        """Give every task started on ``node`` these variables meanwhile (TaskProlog), e.g.
        a PYTHONPATH only that node has: a node whose software differs."""
        if node not in self.node_names:
            raise ValueError(f"no node {node} (nodes: {', '.join(self.node_names)})")
        if any("\n" in f"{k}{v}" for k, v in values.items()):
            raise ValueError("one line per variable")
        folder = self.config.node_env_dir
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / node
        # TaskProlog's lines are read as they are, not by a shell: no quoting.
        path.write_text("".join(f"export {k}={v}\n" for k, v in values.items()))
        try:
            yield
        finally:
            path.unlink(missing_ok=True)

    def _daemon_env(self) -> dict[str, str]:
        return {**os.environ, **self.env()}

    # --- up ----------------------------------------------------------------------------
    def up(self, *, fresh: bool = False, timeout: float = 120.0) -> bool:
        """Start the cluster, or reuse a healthy identical one; True if it was (re)started.

        Raises TestClusterError (with log tails) if the nodes are not idle within timeout.
        """
        if not fresh and self.is_healthy():
            self._say("cluster already up and healthy: reusing it")
            return False
        started = time.monotonic()
        # munged and MariaDB (if ours) keep running: they hold no cluster state.
        self._stop(keep_services=True)
        try:
            self._start(timeout)
        except (daemons.DaemonError, RuntimeError, OSError, subprocess.SubprocessError) as e:
            raise TestClusterError(f"{e}\n\n{self.logs_tail(30)}") from e
        self._say(
            f"cluster up in {time.monotonic() - started:.1f}s: "
            f"{', '.join(self.node_names)} in partitions {', '.join(self.partitions)}"
        )
        return True

    def _start(self, timeout: float) -> None:
        cfg, env = self.config, self._daemon_env()
        self._write_files()
        self._say(
            f"network: bridge {cfg.bridge} {cfg.controller_address}, namespaces "
            f"{cfg.netns(cfg.node_names[0])}..{cfg.netns(cfg.node_names[-1])}, /etc/hosts"
        )
        with machine_lock():
            network.setup(cfg)
            self._make_fake_gpus()
            self._say(f"munged: {daemons.ensure_munged(cfg)}")
            self._say(f"mariadb: {daemons.ensure_mariadb(cfg)}; fresh database {cfg.db_name}")
            daemons.reset_database(cfg)
        self._say("slurmdbd: starting")
        daemons.start_slurmdbd(cfg, env)
        daemons.add_cluster(cfg, env)
        self._say("slurmctld: starting")
        daemons.start_slurmctld(cfg, env)
        for node in cfg.node_names:
            self._say(f"slurmd: starting {node} ({cfg.node_addresses[node]})")
            daemons.start_slurmd(cfg, node, network.netns_path(cfg, node), env)
        try:
            daemons.wait_until(self._nodes_ready, timeout, "all nodes idle", every=0.5)
        except daemons.DaemonError as e:
            states = " ".join(f"{n}={s}" for n, s in self._sinfo_nodes().items())
            raise daemons.DaemonError(f"{e}; sinfo says: {states or 'nothing'}") from e
        # Written last: its presence says a complete cluster with this config came up.
        self._fingerprint_file.write_text(fingerprint(cfg))

    @property
    def _fingerprint_file(self) -> Path:
        return self.config.state_dir / "cluster.fingerprint"

    def _write_files(self) -> None:
        cfg = self.config
        # Fresh state: slurmctld's saved jobs and the node spools go (job ids restart at 1).
        # (state/mariadb stays: a MariaDB we started keeps its log open there.)
        for path in [cfg.ctld_state_dir, cfg.log_dir, *cfg.state_dir.glob("spool-*")]:
            shutil.rmtree(path, ignore_errors=True)
        spools = [cfg.state_dir / f"spool-{n}" for n in cfg.node_names]
        for path in (cfg.state_dir, cfg.log_dir, cfg.pid_dir, cfg.ctld_state_dir, *spools):
            path.mkdir(parents=True, exist_ok=True)
        cfg.slurm_conf.write_text(render_slurm_conf(cfg))
        cfg.gres_conf.write_text(render_gres_conf(cfg))
        # Recipe: slurmdbd refuses a slurmdbd.conf that others can read (mode 600).
        cfg.slurmdbd_conf.write_text(render_slurmdbd_conf(cfg))
        cfg.slurmdbd_conf.chmod(0o600)
        cfg.task_prolog.write_text(render_task_prolog(cfg))
        cfg.task_prolog.chmod(0o755)
        shutil.rmtree(cfg.node_env_dir, ignore_errors=True)  # no node differs after `up`

    def _make_fake_gpus(self) -> None:
        # Recipe, "Fake GPUs": character devices that behave like /dev/null (1, 3).
        for dev in self.config.gpu_devices:
            if dev.exists() and not stat.S_ISCHR(dev.stat().st_mode):
                raise RuntimeError(f"{dev} exists and is not a character device")
            if not dev.exists():
                os.mknod(dev, 0o666 | stat.S_IFCHR, os.makedev(1, 3))

    def _remove_fake_gpus(self) -> None:
        # Only what _make_fake_gpus makes: a character device numbered like /dev/null.
        for dev in self.config.gpu_devices:
            try:
                st = dev.stat()
            except FileNotFoundError:
                continue
            if stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 3):
                dev.unlink()

    # --- down --------------------------------------------------------------------------
    def down(self) -> None:
        """Stop every daemon we started (by pid file), then remove shaping, namespaces, hosts
        block, straggler cgroups and the fake GPU device files; munged, MariaDB and the GPU
        files stay while another cluster on this machine runs (:meth:`others_running`)."""
        with machine_lock():
            shared = not self.others_running()
            self._stop(keep_services=not shared)
            if shared:
                self._remove_fake_gpus()

    def others_running(self) -> list[int]:
        """The other instances (config.instance_settings) whose slurmctld runs now."""
        found = []
        for k in range(MAX_INSTANCES):
            if k != self.config.instance:
                other = ClusterConfig(**instance_settings(k))  # type: ignore[arg-type]
                if other.state_dir != self.state_dir and daemons.daemon_pid(other, "slurmctld"):
                    found.append(k)
        return found

    def _stop(self, *, keep_services: bool) -> None:
        cfg = self.config
        self._fingerprint_file.unlink(missing_ok=True)
        nodes = network.known_nodes(cfg)
        # Also slurmds of an earlier, larger cluster whose namespaces are gone already.
        slurmds = dict.fromkeys(f"slurmd-{node}" for node in nodes)
        slurmds.update(dict.fromkeys(p.stem for p in sorted(cfg.pid_dir.glob("slurmd-*.pid"))))
        stopped = daemons.stop_daemons(cfg, list(slurmds))
        # Job steps and slurmstepd outlive slurmd; they live in the nodes' namespaces.
        leftovers = [pid for node in nodes for pid in network.netns_pids(cfg, node)]
        daemons.kill_pids(leftovers)
        # Reverse start order (docs/testcluster.md): controller, then accounting, then services.
        for name in ("slurmctld", "slurmdbd", *(() if keep_services else ("mariadb", "munged"))):
            stopped += daemons.stop_daemons(cfg, [name])
        if leftovers:
            stopped.append(f"{len(leftovers)} leftover job processes")
        if stopped:
            self._say(f"stopped {', '.join(stopped)}")
        # Kernel state outlives processes. Deleting a namespace takes its qdiscs with it, but
        # one kept alive by a leftover process would keep them: cleared first. The cgroup
        # folders of stragglers are not tied to anything and must be removed explicitly.
        shaping.clear(cfg)
        with machine_lock():
            network.teardown(cfg)
        straggler.unstraggle(cfg)

    # --- a slow fabric and a straggler (docs/testcluster.md) ----------------------------
    def shape(self, rate: str | None, delay: str | None = None,
              nodes: Sequence[str] | None = None) -> list[str]:
        """Shape what ``nodes`` (default: all) send: a rate (``300mbit``) and/or a delay
        (``1ms``; needs a kernel with netem); returns the nodes shaped."""
        return shaping.shape(self.config, rate, delay, nodes)

    def clear_shaping(self, nodes: Sequence[str] | None = None) -> list[str]:
        """Remove the shaping of ``nodes`` (default: all); returns those that had some."""
        return shaping.clear(self.config, nodes)

    def shaping(self) -> dict[str, str]:
        """Node -> ``rate 300mbit delay 1ms`` for the shaped nodes."""
        return shaping.shaped(self.config)

    def straggle(self, node: str, cpu: float) -> int:
        """Cap ``node``'s processes, and its later jobs', at ``cpu`` CPUs (e.g. 0.5)."""
        return straggler.straggle(self.config, node, cpu)

    def unstraggle(self, nodes: Sequence[str] | None = None) -> list[str]:
        """Lift the CPU cap of ``nodes`` (default: every straggler)."""
        return straggler.unstraggle(self.config, nodes)

    def stragglers(self) -> dict[str, float]:
        """Node -> the CPUs it is capped at."""
        return straggler.stragglers(self.config)

    # --- health and status -------------------------------------------------------------
    def _sinfo_nodes(self) -> dict[str, str]:
        """Node -> state (sinfo %t, without the trailing flag such as ``*`` or ``~``)."""
        return {name: state for name, (state, _) in settle.node_states(self.env()).items()}

    def _nodes_ready(self) -> bool:
        states = self._sinfo_nodes()
        return all(states.get(n) in READY_STATES for n in self.node_names)

    def _daemon_pids(self) -> dict[str, int | None]:
        names = ["munged", "mariadb", "slurmdbd", "slurmctld"]
        names += [f"slurmd-{n}" for n in self.node_names]
        return {name: daemons.daemon_pid(self.config, name) for name in names}

    def is_healthy(self) -> bool:
        """Up with this very configuration: daemons alive, network in place, nodes usable."""
        fp = self._fingerprint_file
        if not fp.exists() or fp.read_text() != fingerprint(self.config):
            return False
        pids = self._daemon_pids()
        # munged and mariadb have pid files only when we started them; check them directly.
        slurm_alive = all(pid is not None for n, pid in pids.items() if n.startswith("slurm"))
        return (
            slurm_alive
            and network.is_up(self.config)
            and daemons.munge_works()
            and self._nodes_ready()
        )

    def status(self) -> dict[str, Any]:
        """``up`` (bool), daemon pids (None = not running / not ours), node states, paths."""
        pids = self._daemon_pids()
        slurm_running = any(pid is not None for n, pid in pids.items() if n.startswith("slurm"))
        return {
            "up": self.is_healthy(),
            "state_dir": str(self.state_dir),
            "slurm_conf": str(self.config.slurm_conf),
            "daemons": pids,
            "nodes": self._sinfo_nodes() if slurm_running else {},
            "node_addresses": self.node_addresses,
            "partitions": self.partitions,
            "network": network.is_up(self.config),
            "shaping": shaping.shaped(self.config),
            "stragglers": straggler.stragglers(self.config),
        }

    def logs_tail(self, n: int = 30) -> str:
        """The last ``n`` lines of each daemon log (slurmctld, slurmdbd, slurmd-*, launchers)."""
        log_dir = self.config.log_dir
        if not log_dir.is_dir():
            return f"(no logs: {log_dir} does not exist)"
        parts = []
        order = ["slurmctld.log", "slurmdbd.log"]
        paths = [log_dir / o for o in order] + sorted(
            p for p in log_dir.iterdir() if p.name not in order
        )
        paths.append(self.state_dir / "mariadb" / "mariadb.log")
        for path in paths:
            if not path.is_file() or path.stat().st_size == 0:
                continue
            lines = path.read_text(errors="replace").splitlines()[-n:]
            parts.append(f"==> {path} <==\n" + "\n".join(lines))
        return "\n\n".join(parts) or f"(all logs in {log_dir} are empty)"
