"""What a submit from a laptop costs over the login node's own: the second submit of an
unchanged tree (nothing copied) from the "laptop" of tests/cluster/test_remote.py (no Slurm
configuration, the cluster's storage hidden) against the same submit typed on the login node,
alternating rounds, on the test cluster (docs/remote.md has the figures).

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    rounds = parser.parse_args().rounds
    cluster = TestCluster(say=lambda *_: None)
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
    finally:
        login.down()
        cluster.down()
    return 0


if __name__ == "__main__":
    sys.exit(main())
