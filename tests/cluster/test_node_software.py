"""The same software on every node, on the real cluster: a node whose Python sees one more
distribution stops the run before its first step, naming the node and the package, for the
built-in trainer, a function entry and a script; a venv activated on every node."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_ddp.hostlist import collect
from hpc_ddp.testcluster.cluster import TestCluster
from tests.cluster.slurm_final import assert_completed, assert_ended
from tests.cluster.test_slurm_submit import SMALL, job_id_of
from tests.conftest import REPO, command_env

pytestmark = pytest.mark.cluster
FAST = ["trainer.rendezvous_timeout_s=60", "trainer.collective_timeout_s=30"]


def start(args: list[str], env: dict[str, str], module: str = "submit",
          ) -> subprocess.Popen[str]:
    first = ["wait=true"] if module == "submit" else ["--size-mib", "1", "--iters", "1"]
    return subprocess.Popen([sys.executable, "-m", f"hpc_ddp.{module}", *first, *args],
                            cwd=REPO, env=command_env(env), text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)


def test_a_node_with_other_software_stops_every_kind_of_run_before_training(
        slurm_cluster: TestCluster, slurm_env: dict[str, str], tmp_path: Path) -> None:
    # node3's tasks (the third node's) see one more distribution (a site's extra PYTHONPATH,
    # set by the test cluster's TaskProlog on that node only).
    node3 = slurm_cluster.node_names[2]
    extra = tmp_path / "node3-site"
    info = extra / "fake_drift-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-drift\nVersion: 1.0\n")
    script = tmp_path / "probe.py"
    script.write_text("import pathlib, sys\npathlib.Path(sys.argv[1]).touch()\n")
    started = tmp_path / "script-started"
    runs = {"trainer": ["trainer.max_steps=5"],
            "entry": ["entry=tests.usercode.entries:report"],
            "script": [f"script={script}", "--", str(started)]}
    with slurm_cluster.node_environment(node3, {"PYTHONPATH": str(extra)}):
        procs = {kind: start(["cluster=slurm", "nodes=4", *SMALL, *FAST,
                              f"run_dir={tmp_path / kind}", *args], slurm_env)
                 for kind, args in runs.items()}
        # The doctor, beside them, reports the difference instead of stopping at it.
        doctor = start(["cluster=slurm", "nodes=4", f"run_dir={tmp_path / 'doctor'}"],
                       slurm_env, "doctor")
        outs = {kind: proc.communicate(timeout=300)[0] for kind, proc in procs.items()}
        told = doctor.communicate(timeout=300)[0]
    assert doctor.returncode == 1, told
    assert "differs from the other nodes: fake-drift 1.0 (others not installed)" in told, told
    assert f"Bad node(s): {node3}" in told
    assert_completed(job_id_of(told), slurm_env, told)  # it ran its checks to the end
    for kind, out in outs.items():
        run_dir = tmp_path / kind
        assert procs[kind].returncode == 1, out
        assert "the software differs between the job's nodes" in out, out
        assert f"node(s) {node3} (1 rank(s), e.g. rank 2): fake-drift 1.0 (others not " \
               "installed)" in out, out
        # Stopped before training: no step, no checkpoint; one error (rank 0's), no requeue.
        assert not (run_dir / "progress.json").exists(), kind
        assert not list((run_dir / "checkpoints").glob("*")), kind
        assert [p.name for p in (run_dir / "logs").glob("rank*.error")] == ["rank0.error"]
        assert not (run_dir / "events.jsonl").exists() or "requeue" not in (
            run_dir / "events.jsonl").read_text()
        assert_ended(job_id_of(out), slurm_env, "FAILED", out)
    assert not started.exists()  # the script never started


def test_a_venv_is_activated_on_every_node_and_a_missing_one_named(
        slurm_cluster: TestCluster, slurm_env: dict[str, str], tmp_path: Path) -> None:
    venv = REPO / ".venv"
    # Nothing of the venv in the submitting environment: only the activation on each node
    # can make `python` the venv's there.
    bare = {k: v for k, v in slurm_env.items() if k != "VIRTUAL_ENV"}
    bare["PATH"] = os.pathsep.join(p for p in bare["PATH"].split(os.pathsep)
                                   if not p.startswith(str(venv)))
    common = ["cluster=slurm", "nodes=4", "entry=tests.usercode.entries:where", *FAST]
    good = start([*common, f"cluster.venv={venv}", f"run_dir={tmp_path / 'good'}"], bare)
    bad = start([*common, f"cluster.venv={tmp_path / 'no-venv'}",
                 f"run_dir={tmp_path / 'bad'}"], bare)
    out, _ = good.communicate(timeout=300)
    assert good.returncode == 0, out
    assert_completed(job_id_of(out), slurm_env, out)
    ranks = json.loads((tmp_path / "good" / "summary.json").read_text())["result"]["ranks"]
    assert sorted(r["host"] for r in ranks) == slurm_cluster.node_names
    assert {r["python"] for r in ranks} == {str(venv / "bin" / "python")}
    assert {r["virtual_env"] for r in ranks} == {str(venv)}
    out, _ = bad.communicate(timeout=300)
    assert bad.returncode == 1, out
    assert_ended(job_id_of(out), slurm_env, "FAILED", out)
    # Every rank's error, said once for the four (failures.py).
    nodes = collect(slurm_cluster.node_names)  # node[1-4]
    assert (f"ranks 0-3 on {nodes}: cluster.venv={tmp_path / 'no-venv'}: no virtual "
            f"environment there (no bin/activate) on node {nodes}.") in out, out
