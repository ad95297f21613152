"""A slow fabric and a straggler for the test cluster (hpc_ddp/testcluster/shaping.py,
straggler.py): the values and the CLI's refusals, then the real kernel, on namespaces and a
cgroup of this test's own (``hpcshapetest-<pid>-nodeK``, ``hpcshapetest_<pid>``), never the
test cluster's.

The kernel tests need root and tc/ip/nsenter: without root they skip; without the programs
they skip, except under ``CI=true`` where they fail (as the cluster tests do,
tests/cluster/conftest.py). A kernel without netem (``--delay``) is tested for the clear
refusal it gets; one with netem for the delay itself.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from hpc_ddp.errors import UserError
from hpc_ddp.testcluster import __main__ as cli
from hpc_ddp.testcluster import cluster as cluster_mod
from hpc_ddp.testcluster import shaping, straggler
from hpc_ddp.testcluster.cluster import TestCluster
from hpc_ddp.testcluster.config import ClusterConfig

PREFIX = f"hpcshapetest-{os.getpid()}-"
PROBE = Path(__file__).with_name("tcp_probe.py")
PORT = 5201
# TEST-NET-1, on links that exist only inside this test's namespaces.
ADDRESSES = {"node1": "192.0.2.11", "node2": "192.0.2.12"}
MB8 = 8 * 10**6


# --- the values ------------------------------------------------------------------------------
@pytest.mark.parametrize("rate, bits", [
    ("300mbit", 300 * 10**6), ("1gbit", 10**9), ("500kbit", 500_000), ("1.5gbit", 15 * 10**8),
    ("300Mbit", 300 * 10**6), ("10mbps", 80 * 10**6), ("8kbit", 8000), (" 2mbit ", 2 * 10**6),
])
def test_rates(rate: str, bits: int) -> None:
    assert shaping.rate_bits(rate) == bits


@pytest.mark.parametrize("rate", ["", "300", "300mb", "mbit", "1e3mbit", "-5mbit", "0mbit",
                                  "200gbit", "300 mbit", "1kbit"])
def test_bad_rates(rate: str) -> None:
    with pytest.raises(UserError) as info:
        shaping.rate_bits(rate)
    assert info.value.message.startswith(f"--rate={rate}") and "e.g. 300mbit" in info.value.fix


@pytest.mark.parametrize("delay, seconds", [("1ms", 1e-3), ("200us", 2e-4), ("0.5s", 0.5),
                                            ("0ms", 0.0), ("1.5MS", 1.5e-3)])
def test_delays(delay: str, seconds: float) -> None:
    assert shaping.delay_seconds(delay) == pytest.approx(seconds)


@pytest.mark.parametrize("delay", ["1", "1min", "ms", "11s", "-1ms", "1 ms", "1msec"])
def test_bad_delays(delay: str) -> None:
    with pytest.raises(UserError) as info:
        shaping.delay_seconds(delay)
    assert info.value.key == "--delay" and "1ms" in info.value.fix


def test_what_is_read_back_is_written_as_it_was_asked() -> None:
    assert [shaping.format_rate(b) for b in (3e8, 1e9, 15e8, 5e5, 8123)] == [
        "300mbit", "1gbit", "1500mbit", "500kbit", "8123bit"]
    assert [shaping.format_delay(s) for s in (1e-3, 2e-4, 1.5e-3, 2.0, 2.5)] == [
        "1ms", "200us", "1.5ms", "2s", "2500ms"]


def test_tbf_burst_holds_a_tick_of_traffic_and_one_gso_packet() -> None:
    assert shaping.tbf_args(300 * 10**6) == ["tbf", "rate", "300000000bit", "burst", "150000",
                                             "latency", "200ms"]
    assert shaping.tbf_args(10 * 10**6)[4] == str(64 * 1024)


@pytest.mark.parametrize("cpu", [0.0, 0.001, -1.0, float("nan"), float("inf"), 10**6])
def test_bad_cpu_shares(cpu: float) -> None:
    with pytest.raises(UserError) as info:
        straggler.check_cpu(cpu)
    assert info.value.key == "--cpu" and "--cpu 0.5" in info.value.fix


def test_a_missing_cpu_controller_is_named(tmp_path: Path) -> None:
    said = straggler.controller_missing(tmp_path)
    assert said and "cpu.cfs_quota_us" in said and "mount -t cgroup -o cpu" in said
    with pytest.raises(shaping.MachineLacks, match="cgroup v1 cpu controller"):
        straggler.cap(tmp_path / "group", 0.5, [os.getpid()])
    assert not (tmp_path / "group").exists()
    assert straggler.stragglers(ClusterConfig(state_dir=tmp_path), root=tmp_path / "no") == {}


# --- the CLI ---------------------------------------------------------------------------------
@pytest.fixture
def never_start(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the test cluster must not be checked or touched here")

    monkeypatch.setattr(cli, "requirements_missing", refuse)
    for name in ("up", "down", "status", "shape", "clear_shaping", "straggle", "unstraggle"):
        monkeypatch.setattr(cli.TestCluster, name, refuse)


@pytest.mark.usefixtures("never_start")
@pytest.mark.parametrize("args, said", [
    (["shape"], "--rate=null: shape needs --rate, --delay or both"),
    (["shape", "--rate", "fast"], "--rate=fast: is not a rate"),
    (["shape", "--rate", "0mbit"], "--rate=0mbit: is out of range"),
    (["shape", "--rate", "300mbit", "--delay", "1 ms"], "--delay=1 ms: is not a delay"),
    (["shape", "--delay=-1ms"], "--delay=-1ms: is not a delay"),
    (["shape", "--clear", "--rate", "1mbit"], "--clear=true: removes"),
    (["shape", "--rate", "1mbit", "--cpu", "1"], "--cpu=1.0: is not an option of shape"),
    (["straggle", "--cpu", "0.5"], "--node=null: straggle needs one --node"),
    (["straggle", "--node", "node3"], "--cpu=null: straggle needs --cpu"),
    (["straggle", "--node", "node3", "--cpu", "0"], "--cpu=0.0: must be between 0.01"),
    (["straggle", "--node", "node3", "--cpu", "nan"], "--cpu=nan"),
    (["straggle", "--node", "a", "--node", "b", "--cpu", "0.5"], "--node=a b"),
    (["straggle", "--node", "node3", "--cpu", "0.5", "--rate", "1mbit"],
     "--rate=1mbit: is not an option of straggle"),
    (["up", "--rate", "1mbit"], "--rate=1mbit: is not an option of up"),
    (["status", "--clear"], "--clear=true: is not an option of status"),
])
def test_bad_usage_is_one_line_and_exit_2(args: list[str], said: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert said in err and "Fix:" in err


def _raise(exc: Exception) -> Callable[..., Any]:
    def fail(*args: object, **kwargs: object) -> Any:
        raise exc

    return fail


@pytest.mark.parametrize("args, method, does, code, said", [
    (["shape", "--rate", "300mbit", "--node", "node2"], "shape", lambda *a: ["node2"], 0,
     "shaped node2: --rate 300mbit on eth0"),
    (["shape", "--clear"], "clear_shaping", lambda *a: [], 0, "shaping cleared: none was set"),
    (["straggle", "--node", "node3", "--cpu", "0.5"], "straggle", lambda *a: 3, 0,
     "node3 capped at 0.5 CPU (3 processes now"),
    (["straggle", "--clear"], "unstraggle", lambda *a: ["node3"], 0,
     "stragglers cleared: node3"),
    (["shape", "--rate", "1mbit", "--node", "node9"], "shape",
     _raise(UserError("--node", "node9", "is not a node.", "choose.")), 2, "error: --node=node9"),
    (["shape", "--delay", "1ms"], "shape", _raise(shaping.MachineLacks("no netem")), 4,
     "cannot shape here: no netem"),
    (["straggle", "--node", "node3", "--cpu", "0.5"], "straggle",
     _raise(shaping.ShapingError("slurmd of node3 is not running")), 1,
     "straggle failed: slurmd of node3"),
])
def test_shape_and_straggle_commands_and_their_exit_codes(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], args: list[str],
        method: str, does: Callable[..., Any], code: int, said: str) -> None:
    monkeypatch.setattr(cli, "requirements_missing", lambda: None)
    monkeypatch.setattr(cli.TestCluster, method, lambda self, *a: does(*a))
    assert cli.main(args) == code
    out = capsys.readouterr()
    assert said in out.out + out.err


def test_status_shows_shaping_and_stragglers(capsys: pytest.CaptureFixture[str]) -> None:
    cli._print_status({"up": True, "state_dir": "/s", "daemons": {}, "nodes": {},
                       "partitions": ["normal"], "network": True,
                       "shaping": {"node1": "rate 300mbit delay 1ms", "node2": "rate 1gbit"},
                       "stragglers": {"node3": 0.5}})
    assert ("shaping: node1 rate 300mbit delay 1ms; node2 rate 1gbit; stragglers: node3 0.5 CPU"
            in capsys.readouterr().out)


def test_down_and_a_fresh_up_clear_shaping_and_stragglers(monkeypatch: pytest.MonkeyPatch,
                                                          tmp_path: Path) -> None:
    """Recorded, not run: stand-ins replace whole modules, so anything the stand-ins lack
    fails instead of reaching the machine's real cluster."""
    calls: list[str] = []

    def record(name: str, value: Any = None) -> Callable[..., Any]:
        return lambda *args, **kwargs: calls.append(name) or value

    monkeypatch.setattr(cluster_mod, "network", SimpleNamespace(
        known_nodes=record("known_nodes", []), netns_pids=record("netns_pids", []),
        teardown=record("teardown")))
    monkeypatch.setattr(cluster_mod, "daemons", SimpleNamespace(
        stop_daemons=record("stop_daemons", []), kill_pids=record("kill_pids"),
        daemon_pid=lambda cfg, name: None))  # no other cluster runs beside it
    monkeypatch.setattr(cluster_mod, "shaping", SimpleNamespace(clear=record("clear")))
    monkeypatch.setattr(cluster_mod, "straggler", SimpleNamespace(
        unstraggle=record("unstraggle")))
    monkeypatch.setattr(TestCluster, "_remove_fake_gpus", record("remove_fake_gpus"))
    monkeypatch.setattr(TestCluster, "_start", record("start"))
    cluster = TestCluster(tmp_path, nodes=2)
    cluster.down()
    assert calls.index("clear") < calls.index("teardown") < calls.index("unstraggle")
    calls.clear()
    cluster.up(fresh=True)
    assert calls.index("clear") < calls.index("unstraggle") < calls.index("start")


# --- the real kernel -------------------------------------------------------------------------
def _kernel_or_skip(*programs: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (namespaces, tc, cgroups): sudo .venv/bin/pytest " + __file__)
    missing = [p for p in programs if shutil.which(p) is None]
    if missing:
        msg = f"{', '.join(missing)} not installed: apt-get install iproute2 util-linux"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg)


class ShapeTestConfig(ClusterConfig):
    """The cluster's configuration with this test's namespaces: hpcshapetest-<pid>-nodeK."""

    def netns(self, node: str) -> str:
        return f"{PREFIX}{node}"


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


def _enter(cfg: ClusterConfig, node: str, *cmd: str) -> list[str]:
    return ["nsenter", f"--net=/run/netns/{cfg.netns(node)}", *cmd]


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ShapeTestConfig]:
    """node1 and node2: two namespaces whose eth0s are one veth pair, and a TCP sink on
    node2. Removed afterwards with whatever runs in them."""
    _kernel_or_skip("ip", "tc", "nsenter")
    cfg = ShapeTestConfig(state_dir=tmp_path_factory.mktemp("state"), nodes=2)
    server = None
    try:
        for node in ADDRESSES:
            _run("ip", "netns", "add", cfg.netns(node))
        _run("ip", "-n", cfg.netns("node1"), "link", "add", "eth0", "type", "veth",
             "peer", "name", "eth0", "netns", cfg.netns("node2"))
        for node, addr in ADDRESSES.items():
            _run("ip", "-n", cfg.netns(node), "addr", "add", f"{addr}/24", "dev", "eth0")
            _run("ip", "-n", cfg.netns(node), "link", "set", "eth0", "up")
        server = subprocess.Popen(
            _enter(cfg, "node2", sys.executable, str(PROBE), "serve", ADDRESSES["node2"],
                   str(PORT)), stdout=subprocess.PIPE, text=True)
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        yield cfg
    finally:
        if server is not None:
            server.kill()
            server.wait()
        for node in ADDRESSES:
            if Path(f"/run/netns/{cfg.netns(node)}").exists():
                subprocess.run(["ip", "netns", "del", cfg.netns(node)], capture_output=True)


def _send(cfg: ClusterConfig, nbytes: int = MB8) -> dict[str, float]:
    done = subprocess.run(
        _enter(cfg, "node1", sys.executable, str(PROBE), "send", ADDRESSES["node2"], str(PORT),
               str(nbytes)), capture_output=True, text=True, timeout=60, check=True)
    result: dict[str, float] = json.loads(done.stdout)
    return result


def _tc_show(cfg: ClusterConfig, node: str) -> str:
    return subprocess.run(["tc", "-n", cfg.netns(node), "qdisc", "show", "dev", "eth0"],
                          capture_output=True, text=True, check=True).stdout


def test_a_shaped_rate_slows_traffic_for_real(two_nodes: ShapeTestConfig) -> None:
    cfg = two_nodes
    assert shaping.running_nodes(cfg) == ["node1", "node2"]
    free = _send(cfg)
    try:
        assert shaping.shape(cfg, "300mbit", None) == ["node1", "node2"]
        assert shaping.shaped(cfg) == {"node1": "rate 300mbit", "node2": "rate 300mbit"}
        assert "qdisc tbf" in _tc_show(cfg, "node1") and "rate 300Mbit" in _tc_show(cfg, "node1")
        slow = _send(cfg)
        # 8 MB at 300 Mbit/s is ~0.21 s; measured here 283-291 Mbit/s against 4-10 Gbit/s
        # unshaped. The bucket's first 150 kB leave at once: a little over the rate is fine.
        assert 100 < slow["mbit_s"] <= 345, (slow, free)
        assert free["mbit_s"] > 2 * slow["mbit_s"], (slow, free)
        # Again, on one node: replaced, not added to.
        assert shaping.shape(cfg, "100mbit", None, nodes=["node1"]) == ["node1"]
        assert shaping.shaped(cfg) == {"node1": "rate 100mbit", "node2": "rate 300mbit"}
        slower = _send(cfg, MB8 // 2)
        assert slower["mbit_s"] <= 115, slower
        with pytest.raises(UserError, match="--node=node7: is not a node of the running"):
            shaping.shape(cfg, "1mbit", None, nodes=["node7"])
        assert shaping.shaped(cfg)["node2"] == "rate 300mbit"
    finally:
        cleared = shaping.clear(cfg)
    assert cleared == ["node1", "node2"]
    assert shaping.shaped(cfg) == {} and shaping.clear(cfg) == []  # idempotent
    assert "noqueue" in _tc_show(cfg, "node1")


def test_a_delay_lengthens_the_round_trip_or_is_refused_by_a_kernel_without_netem(
        two_nodes: ShapeTestConfig) -> None:
    cfg = two_nodes
    free = min(_send(cfg, 1)["connect_s"] for _ in range(3))
    try:
        try:
            shaping.shape(cfg, "300mbit", "20ms")
        except shaping.MachineLacks as e:
            assert "no netem qdisc" in str(e) and "rate alone" in str(e)
            assert shaping.shaped(cfg) == {}  # nothing half done
            config = Path("/proc/config.gz")
            if config.exists():
                assert "CONFIG_NET_SCH_NETEM=y" not in gzip.decompress(
                    config.read_bytes()).decode()
            return
        both = "rate 300mbit delay 20ms"
        assert shaping.shaped(cfg) == {"node1": both, "node2": both}
        assert "netem" in _tc_show(cfg, "node1") and "tbf" in _tc_show(cfg, "node1")
        # A connect is one round trip: SYN out of node1's eth0, SYN-ACK out of node2's.
        delayed = _send(cfg, 1)["connect_s"]
        assert delayed >= 0.038 and delayed > free + 0.03, (delayed, free)
        shaping.shape(cfg, None, "1ms")
        assert shaping.shaped(cfg) == {"node1": "delay 1ms", "node2": "delay 1ms"}
    finally:
        shaping.clear(cfg)
    assert shaping.shaped(cfg) == {}


def _cpu_share(pid: int, wall: float = 1.0) -> float:
    """CPUs ``pid`` used over ``wall`` seconds (utime + stime of /proc/PID/stat)."""

    def used() -> float:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    before, start = used(), time.monotonic()
    time.sleep(wall)
    return (used() - before) / (time.monotonic() - start)


def test_a_straggler_gets_its_cap_until_released(two_nodes: ShapeTestConfig) -> None:
    """A busy loop in node1's namespace, posing as its slurmd (pid file, comm), is capped at
    0.1 CPU, then released. The groups live under a parent group of this test's own."""
    _kernel_or_skip()
    missing = straggler.controller_missing()
    if missing:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(missing, pytrace=False)
        pytest.skip(missing)
    cfg = two_nodes
    parent = straggler.CPU_CGROUP / f"hpcshapetest_{os.getpid()}"
    parent.mkdir()
    busy = subprocess.Popen(_enter(cfg, "node1", sys.executable, "-c",
                                   "import pathlib; pathlib.Path('/proc/self/comm')"
                                   ".write_text('slurmd'); print('ready', flush=True)\n"
                                   "while True: pass"), stdout=subprocess.PIPE, text=True)
    try:
        assert busy.stdout is not None and busy.stdout.readline().strip() == "ready"
        cfg.pid_dir.mkdir(parents=True, exist_ok=True)
        cfg.pid_file("slurmd-node1").write_text(f"{busy.pid}\n")
        assert straggler.straggle(cfg, "node1", 0.1, root=parent) == 1
        group = parent / "hpc_ddp_testcluster_node1"
        assert (group / "cgroup.procs").read_text().split() == [str(busy.pid)]
        assert straggler.stragglers(cfg, root=parent) == {"node1": pytest.approx(0.1)}
        capped = _cpu_share(busy.pid)
        assert straggler.unstraggle(cfg, root=parent) == ["node1"]
        assert not group.exists() and straggler.stragglers(cfg, root=parent) == {}
        assert straggler.unstraggle(cfg, root=parent) == []  # idempotent
        free = _cpu_share(busy.pid)
        # Capped: at most 0.1 CPU (a tick of slack); free: what a busy machine still gives
        # a busy loop at this test's nice 10 (0.22-1.0 here, with the suite's cluster tests
        # on both cores): more than a capped one can get.
        assert 0.03 < capped <= 0.15 and free > 1.5 * capped, (capped, free)
    finally:
        busy.kill()
        busy.wait()
        straggler.unstraggle(cfg, root=parent)
        straggler.uncap(parent)
    assert not parent.exists()


def test_the_machine_lock_takes_no_link_and_no_other_users_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The clusters' lock lives beside the state folder (/tmp by default): a link or a file
    another user planted there is refused by name, never followed or used."""
    from hpc_ddp.testcluster.cluster import TestClusterError, machine_lock

    monkeypatch.setenv("HPC_DDP_TESTCLUSTER_DIR", str(tmp_path / "state"))
    lock = tmp_path / "hpc_ddp_testcluster.lock"
    with machine_lock(), machine_lock():  # reentrant in one process
        assert lock.is_file() and (lock.stat().st_mode & 0o777) == 0o600
    lock.unlink()
    target = tmp_path / "elsewhere"
    lock.symlink_to(target)
    with pytest.raises(TestClusterError, match="cannot be the clusters' lock"), machine_lock():
        pass
    assert not target.exists()
    lock.unlink()
    if os.geteuid() == 0:  # a second user's file (as root: chown it to nobody)
        lock.write_text("")
        os.chown(lock, 65534, 65534)
        with pytest.raises(TestClusterError, match="belongs to another user"), machine_lock():
            pass
