"""data.stage on the real 4-node cluster: each node stages exactly once (counted), the ranks
of a node share its copy, a requeue and a later job reuse it, a function entry stages through
its context, and a node without the space is named.

The test cluster's nodes share this machine's file system, so every node keeps its copy under
its own host folder of one stage_dir (stage_dir/hpc_ddp-stage-<uid>/<host>/, as on a real cluster
where stage_dir is each node's own disk), and the full disk is a 16 KiB tmpfs mounted on
node3's folder only: the space check reads that node's own free space, as it would on a
node's local disk.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hpc_ddp.data import fake_images, pack
from hpc_ddp.testcluster.cluster import TestCluster
from tests.cluster.slurm_final import assert_completed, assert_ended
from tests.cluster.test_fault_tolerance import (
    assert_completed_at_last,
    finish_releasing_requeues,
    wait_for_step,
)
from tests.cluster.test_slurm_submit import job_id_of, summary_of

pytestmark = pytest.mark.cluster
# This user's folder under a stage_dir (hpc_ddp/data/stage_folders.py).
TOP = f"hpc_ddp-stage-{os.geteuid()}"
Run = Callable[..., subprocess.CompletedProcess[str]]
COMMON = ["cluster=slurm", "trainer.collective_timeout_s=60", "trainer.rendezvous_timeout_s=60"]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("staging")
    fake_images.write_folder(root / "images", 3, {"train": 30, "val": 5}, (48, 40))
    pack.pack_folder(str(root / "images"), str(root / "shards"), samples_per_shard=10,
                     out=open("/dev/null", "w"))  # noqa: SIM115
    return root


def reads(run_dir: Path) -> dict[int, tuple[str, str, str]]:
    """rank -> (host, the copy it reads, how) from each rank's log (the latest start)."""
    found = {}
    for log in (run_dir / "logs").glob("rank*.log"):
        for line in log.read_text().splitlines():
            hit = re.search(r"data\.stage: rank (\d+) on (\S+) reads (\S+) \((.*)\)$", line)
            if hit:
                found[int(hit[1])] = (hit[2], hit[3], hit[4])
    return found


def staged_lines(run_dir: Path) -> list[str]:
    return [line for log in sorted((run_dir / "logs").glob("rank*.log"))
            for line in log.read_text().splitlines() if "] INFO staged " in line]


def test_each_node_stages_once_shares_it_and_a_requeue_reuses_it(
        hpc_ddp: Run, slurm_cluster: TestCluster, slurm_env: dict[str, str], data: Path,
        tmp_path: Path,
        request: pytest.FixtureRequest) -> None:
    stage_dir, run_dir = tmp_path / "stage", tmp_path / "run"
    # 8 ranks on the 2 shared cores: each in its own process, without a supervisor (staging is
    # what is tested here; a requeue still goes through the stop agreement).
    done = hpc_ddp("submit", [*COMMON, "nodes=4", "cluster.tasks_per_node=2", "data=shards",
                              "cluster.supervise=false",
                              f"data.root={data / 'shards'}", "data.stage=true",
                              f"data.stage_dir={stage_dir}", "data.image_size=32",
                              "model=tiny_cnn", "trainer.batch_size=4", "trainer.max_steps=60",
                              "trainer.checkpoint_interval=10", "trainer.log_interval=5",
                              "trainer.eval_interval=60", "trainer.stop_check_interval=2",
                              f"run_dir={run_dir}"], env=slurm_env)
    assert done.returncode == 0, done.stdout + done.stderr
    job = job_id_of(done.stdout)
    request.addfinalizer(lambda: subprocess.run(["scancel", job], env=slurm_env, check=False))
    wait_for_step(run_dir, 10)
    first = reads(run_dir)
    lines = staged_lines(run_dir)
    nodes = slurm_cluster.node_names
    assert len(lines) == 4 and sorted(re.findall(rf" on ({slurm_cluster.config.node_prefix}\d): ",
                                                  " ".join(lines))) == nodes
    for node in nodes:  # exactly one rank per node copied; both of its ranks read that copy
        ranks = {r: v for r, v in first.items() if v[0] == node}
        assert len(ranks) == 2 and len({v[1] for v in ranks.values()}) == 1, ranks
        assert sorted(v[2] for v in ranks.values()) == ["copied here", "this node's copy"]
        assert f"/{TOP}/{node}/" in next(iter(ranks.values()))[1]
        manifest = next((stage_dir / TOP / node).glob("shards-*/*/manifest.json"))
        assert json.loads(manifest.read_text())["host"] == node
    progress = (run_dir / "logs" / "rank0.log").read_text()
    assert re.search(r"INFO staging \S+shards: .* of .* \(100%\), [\d.]+ MB/s", progress)

    subprocess.run(["scancel", "--signal=USR2", job], env=slurm_env, check=True)  # requeue
    assert finish_releasing_requeues(job, run_dir, slurm_env) >= 1
    assert_completed_at_last(job, slurm_env)
    summary = summary_of(run_dir)
    assert summary["restarts"] == 1 and summary["global_step"] == 60
    stage = summary["data_stage"]  # the last start's: every node reused its copy
    assert stage["nodes"] == 4 and stage["nodes_staged"] == 0 and stage["nodes_reused"] == 4
    assert stage["files"] == len([p for p in (data / "shards").rglob("*") if p.is_file()])
    assert len(staged_lines(run_dir)) == 4  # no second copy anywhere
    assert {r: v[1] for r, v in reads(run_dir).items()} == {r: v[1] for r, v in first.items()}


def test_a_function_entry_stages_through_its_context_and_reuses_other_jobs_copies(
        hpc_ddp: Run, slurm_env: dict[str, str], data: Path, tmp_path: Path) -> None:
    stage_dir, run_dir = tmp_path / "stage", tmp_path / "run"
    args = [*COMMON, "nodes=2", "cluster.tasks_per_node=2", "data=image_folder",
            f"data.root={data / 'images'}", "data.stage=true", f"data.stage_dir={stage_dir}",
            "entry=tests.usercode.entries:staged", f"app.extra={data / 'shards'}",
            "wait=true"]
    for attempt in ("first", "again"):  # a second job on the same stage_dir reuses
        done = hpc_ddp("submit", [*args, f"run_dir={run_dir}-{attempt}"], env=slurm_env,
                       timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        assert_completed(job_id_of(done.stdout), slurm_env, done.stdout)
    first, again = summary_of(Path(f"{run_dir}-first")), summary_of(Path(f"{run_dir}-again"))
    assert first["data_stage"]["nodes_staged"] == 2
    assert again["data_stage"]["nodes_reused"] == 2 and again["data_stage"]["nodes_staged"] == 0
    result = first["result"]
    node = first["nodes"][0]
    assert result["data_root"].startswith(f"{stage_dir}/{TOP}/{node}/images-")
    assert result["extra"].startswith(f"{stage_dir}/{TOP}/{node}/shards-")
    assert "index.json" in result["extra_files"]


@pytest.fixture
def full_node3(tmp_path: Path, slurm_cluster: TestCluster) -> Iterator[Path]:
    """A stage_dir whose third node's folder is a 16 KiB tmpfs (that node's small, full
    disk)."""
    stage_dir = tmp_path / "stage"
    mount = stage_dir / TOP / slurm_cluster.node_names[2]
    mount.mkdir(parents=True)
    # mode 0700: a stage folder must be private (hpc_ddp/data/stage_folders.py)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k,mode=0700", "tmpfs", str(mount)],
                   check=True)
    try:
        yield stage_dir
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_a_node_without_the_space_is_named(hpc_ddp: Run, slurm_cluster: TestCluster,
                                           slurm_env: dict[str, str], data: Path,
                                           tmp_path: Path, full_node3: Path) -> None:
    *others, node3 = slurm_cluster.node_names[:3]
    others.append(slurm_cluster.node_names[3])
    archive = tmp_path / "images.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(data / "images", arcname="images")
    run_dir = tmp_path / "run"
    done = hpc_ddp("submit", [*COMMON, "nodes=4", "data=image_folder", f"data.root={archive}",
                              "data.stage=true", f"data.stage_dir={full_node3}",
                              "model=tiny_cnn", "data.image_size=32", "model.num_classes=3",
                              "trainer.max_steps=5", f"run_dir={run_dir}", "wait=true"],
                   env=slurm_env, timeout=300)
    assert done.returncode != 0
    size = archive.stat().st_size
    said = re.search(rf"node {node3} has ([\d.]+ [KM]iB) free there but the data set needs .* "
                     rf"\({size} bytes needed, (\d+) free\)", done.stdout)
    assert said, done.stdout
    assert int(said[2]) < size
    assert_ended(job_id_of(done.stdout), slurm_env, "FAILED", done.stdout)
    errors = {p.name: p.read_text() for p in (run_dir / "logs").glob("rank*.error")}
    assert len(errors) == 4 and all(f"node {node3} has" in e for e in errors.values())
    for node in others:  # the others staged; node3 holds nothing
        assert list((full_node3 / TOP / node).glob("images-*/*/manifest.json"))
    assert not list((full_node3 / TOP / node3).rglob("*.partial"))
