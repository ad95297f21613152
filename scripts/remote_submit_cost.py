"""What the remote path costs over working on the login node, on the test cluster (its four
nodes declared with 16 CPUs each), from the "laptop" of tests/cluster/test_remote.py (no Slurm
configuration, the cluster's storage hidden), alternating rounds (docs/remote.md has the
figures):

- the second submit of an unchanged tree (nothing copied), against the same submit typed on
  the login node;
- ``status`` and ``logs --tail 20`` of a running 64-rank job (4 nodes x 16 tasks of a script
  that writes 200 lines each, then waits), from the laptop against on the login node.

    sudo .venv/bin/python scripts/remote_submit_cost.py --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hpc_ddp.testcluster.cluster import TestCluster  # noqa: E402
from hpc_ddp.testcluster.login import LoginNode  # noqa: E402
from tests.cluster.test_remote import _project, laptop  # noqa: E402

# Each of the 64 ranks: 200 lines to its standard output, then it waits to be cancelled.
CHATTY = """\
import os, sys, time
rank = os.environ["RANK"]
for i in range(200):
    print(f"rank {rank} line {i} loss {1 / (i + 1):.4f}", flush=True)
time.sleep(600)
"""


def wide_run(storage: Path, project: Path, remote: list[str], env: dict[str, str],
             tmp: Path, rounds: int) -> None:
    """status and logs --tail of a running 64-rank job: laptop vs login node."""
    (project / "chatty.py").write_text(CHATTY)
    done = laptop(storage, "submit", [*remote, "nodes=4", "cluster.tasks_per_node=16",
                                      "script=chatty.py", "run_dir=runs/wide"], project)
    assert done.returncode == 0, done.stdout + done.stderr
    handle = str(project / "runs" / "wide")
    from hpc_ddp.remote.handle import read

    record = read(project / "runs" / "wide")
    assert record is not None
    logs = Path(record.remote_dir) / "logs"
    deadline = time.monotonic() + 180
    while sum(1 for p in logs.glob("rank*.log")
              if p.read_text().count(" line ") >= 200) < 64:
        assert time.monotonic() < deadline, "the 64 ranks did not all write their lines"
        time.sleep(2)
    for args in (["status"], ["logs", "--tail", "20"]):
        from_laptop, on_login = [], []
        for _ in range(rounds):
            started = time.monotonic()
            there = laptop(storage, args[0], [handle, *args[1:]], project)
            from_laptop.append(time.monotonic() - started)
            assert there.returncode == 0 and "RUNNING" in there.stdout or args[0] == "logs", (
                there.stdout + there.stderr)
            started = time.monotonic()
            here = subprocess.run([sys.executable, "-m", f"hpc_ddp.{args[0]}",
                                   record.remote_dir, *args[1:]], env=env,
                                  capture_output=True, text=True, check=False)
            on_login.append(time.monotonic() - started)
            assert here.returncode == 0, here.stderr
            assert len(here.stdout) == len(there.stdout) or args[0] == "status", (
                here.stdout, there.stdout)
        a, b = statistics.median(from_laptop), statistics.median(on_login)
        print(f"{' '.join(args)} of a running 64-rank job, median of {rounds}: from the "
              f"laptop {a:.2f} s, on the login node {b:.2f} s: {a - b:+.2f} s")
    subprocess.run(["scancel", str(record.job_id)], env=env, check=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    rounds = parser.parse_args().rounds
    cluster = TestCluster(cpus=16, say=lambda *_: None)
    cluster.up()
    tmp = Path(tempfile.mkdtemp(prefix="hpc_ddp_remote_cost."))
    login = LoginNode(cluster.config, tmp / "login", Path(cluster.env()["SLURM_CONF"]))
    login.up()
    try:
        storage = tmp / "cluster_storage"
        storage.mkdir()
        project = _project(tmp / "laptop" / "project")
        common = ["cluster=slurm", "nodes=1", "script=train.py",
                  f"cluster.python={sys.executable}", "cluster.restarts_in_place=0"]
        remote = [*common, "cluster.remote=login", f"cluster.ssh_config={login.ssh_config}",
                  f"cluster.remote_root={storage}"]
        first = laptop(storage, "submit", [*remote, "run_dir=runs/first"], project)
        assert first.returncode == 0, first.stdout + first.stderr
        env = {**os.environ, **cluster.env()}
        from_laptop, on_login = [], []
        for i in range(rounds):
            started = time.monotonic()
            done = laptop(storage, "submit", [*remote, f"run_dir=runs/r{i}"], project)
            from_laptop.append(time.monotonic() - started)
            assert done.returncode == 0 and "copying" not in done.stdout, done.stdout
            started = time.monotonic()
            here = subprocess.run([sys.executable, "-m", "hpc_ddp.submit", *common,
                                   f"run_dir={tmp}/login_runs/r{i}"], cwd=project, env=env,
                                  capture_output=True, text=True, check=False)
            on_login.append(time.monotonic() - started)
            assert here.returncode == 0, here.stderr
            time.sleep(8)  # the jobs end before the next round
        a, b = statistics.median(from_laptop), statistics.median(on_login)
        print(f"second submit of an unchanged tree, median of {rounds}: from the laptop "
              f"{a:.2f} s, on the login node {b:.2f} s: {a - b:+.2f} s "
              f"(laptop {', '.join(f'{x:.2f}' for x in from_laptop)}; login node "
              f"{', '.join(f'{x:.2f}' for x in on_login)})")
        time.sleep(10)
        wide_run(storage, project, remote, env, tmp, rounds)
        time.sleep(5)
    finally:
        login.down()
        cluster.down()
    return 0


if __name__ == "__main__":
    sys.exit(main())
