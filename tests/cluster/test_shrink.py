"""A node lost with no spare left and ``cluster.min_nodes``: the same job goes on with the nodes
that remain, the same global batch and the same samples at every step (docs/fault-
tolerance.md#shrinking-past-a-lost-node), on the real 4-node cluster. The samples each rank
trains on are recorded by the test's own model (tests/usercode/parts.py IdRecorder), not by
hpc_ddp."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hpc_ddp import events
from hpc_ddp.api import scalars_in
from tests.cluster.test_fault_tolerance import (
    assert_one_start_completed,
    take_down,
    wait_for_step,
)
from tests.cluster.test_slurm_submit import job_id_of
from tests.conftest import REPO

pytestmark = pytest.mark.cluster

STEPS = 48
# 16 a rank on 4 ranks: a global batch of 64, an epoch of 1024 // 64 = 16 steps (the run:
# three); on 3 ranks 22, 21 and 21 samples. A step takes 0.05 s (the test's model sleeps).
ARGS = ["cluster=slurm", "nodes=4", "cluster.min_nodes=3", f"trainer.max_steps={STEPS}",
        "trainer.batch_size=16", "data._target_=tests.usercode.parts.id_images",
        "data.size=1024", "model._target_=tests.usercode.parts.IdRecorder",
        "model.delay_s=0.05", "app.delay_s=0.05",
        "data.num_workers=0", "trainer.checkpoint_interval=8", "trainer.log_interval=8",
        "trainer.eval_interval=1000", "trainer.stop_check_interval=2",
        "trainer.collective_timeout_s=20", "trainer.rendezvous_timeout_s=60"]
# Losses after the change against the uninterrupted run's, relative: the same samples and
# global batch, summed in another order. At the first logged step after the change (the mean
# of up to 8 steps) the difference is rounding carried a few steps: measured 9.7e-7 to 3.1e-4,
# the most when the run resumed from step 8, where the loss still falls fast (FSDP,
# 2026-12-05); SGD carries it on (measured at most 1.7e-4 later on).
LOSS_TOLERANCE = 1e-3


# The three kinds of training a shrink must carry: the built-in trainer (DDP), the built-in
# trainer sharded (FSDP2), a function entry of the user's own (ctx.shard, ctx.global_batches).
KINDS = {
    "trainer": [],
    "fsdp": ["trainer.strategy=fsdp"],
    "entry": ["entry=tests.usercode.entries:ordered_sharded", f"app.steps={STEPS}",
              "app.batch_size=16", "app.size=1024"],
}


def submit(run_dir: Path, records: Path, env: dict[str, str], wait: bool,
           extra: list[str]) -> str:
    records.mkdir(parents=True)
    keys = {arg.split("=", 1)[0] for arg in extra}
    done = subprocess.run([sys.executable, "-m", "hpc_ddp.submit",
                           *(arg for arg in ARGS if arg.split("=", 1)[0] not in keys), *extra,
                           f"model.record_dir={records}", f"app.record_dir={records}",
                           f"run_dir={run_dir}", f"wait={'true' if wait else 'false'}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return job_id_of(done.stdout)


@contextlib.contextmanager
def node_down(node: str, env: dict[str, str]) -> Iterator[None]:
    """``node`` DOWN as a dead one (take_down) for the block, back in service after it."""
    try:
        take_down(node, env)
        yield
    finally:
        subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], env=env,
                       check=False)


def lose_a_node_and_finish(run_dir: Path, env: dict[str, str], what: str) -> str:
    """rank 1's node DOWN until the run (``what``) has written its summary in the same job;
    the node it lost."""
    victim: str = json.loads((run_dir / "ranks" / "rank1.json").read_text())["host"]
    with node_down(victim, env):
        deadline = time.monotonic() + 300
        while not (run_dir / "summary.json").exists():
            assert time.monotonic() < deadline, f"the shrunk {what} did not finish"
            time.sleep(1)
    return victim


def starts_of(records: Path, settles: bool) -> list[list[Counter[int]]]:
    """Per start of the ranks (the driver's relaunch, the supervisors' generation), in
    order: its micro-batches, each the multiset of the sample ids all its ranks trained on.
    ``settles``: each start's first forward is DDP's bucket settling on the set's first
    batch (the built-in trainer under DDP), not a step."""
    starts: dict[tuple[int, ...], list[list[list[int]]]] = defaultdict(list)
    for path in sorted(records.glob("rank*.jsonl")):
        mine: dict[tuple[int, ...], list[list[int]]] = defaultdict(list)
        for line in path.read_text().splitlines():
            record = json.loads(line)
            mine[tuple(int(x) for x in record["start"])].append(record["ids"])
        for start, batches in mine.items():
            starts[start].append(batches[1:] if settles else batches)
    return [[Counter(i for rank in ranks for i in rank[k])
             for k in range(min(len(rank) for rank in ranks))]
            for _, ranks in sorted(starts.items())]


@pytest.fixture(scope="module")
def reference(slurm_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """An uninterrupted 4-node run (built-in trainer): its losses and every step's samples,
    which depend only on the data, the seed and the global batch (the same for all KINDS)."""
    root = tmp_path_factory.mktemp("shrink_reference")
    submit(root / "run", root / "ids", {**os.environ, **slurm_cluster.env()}, True, [])
    (steps,) = starts_of(root / "ids", settles=True)
    assert len(steps) == STEPS and all(sum(s.values()) == 64 for s in steps)
    return {"steps": steps, "losses": dict(scalars_in(root / "run" / "tb",
                                                      "train/loss")["train/loss"])}


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_lost_node_without_a_spare_shrinks_the_job_with_the_same_batches_and_samples(
        kind: str, reference: dict[str, Any], slurm_env: dict[str, str],
        tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    job = submit(run_dir, tmp_path / "ids", slurm_env, False, KINDS[kind])
    wait_for_step(run_dir, 20)  # past the checkpoint at 16, which the shrunk run resumes from
    down_at = time.time()
    victim = lose_a_node_and_finish(run_dir, slurm_env, "run")
    # The same job: no requeue, COMPLETED 0:0; every step trained, the last ones on 3 nodes.
    assert_one_start_completed(job, slurm_env)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 3 and victim not in summary["hosts"]
    assert summary.get("global_step", summary.get("result", {}).get("step")) == STEPS, summary
    assert summary["requeues"] == 0
    seen = events.read(run_dir)
    kinds = [e["kind"] for e in seen]
    assert "shrink" in kinds and "requeue" not in kinds
    (shrink,) = summary["shrinks"]
    assert shrink["lost"] == [victim] and (shrink["world_before"], shrink["world_after"]) == (4, 3)
    recovered = next(e for e in seen if e["kind"] == "recovered")
    print(f"{kind}: node {victim} DOWN -> training again on 3 nodes: "
          f"{recovered['time'] - down_at:.1f} s")

    # Every step after the change trained on the uninterrupted run's samples, 64 a step.
    starts = starts_of(tmp_path / "ids", settles=kind == "trainer")
    assert len(starts) == 2, [len(x) for x in starts]
    before, after = starts
    expected = reference["steps"]
    assert before == expected[:len(before)] and 0 < len(after) < STEPS
    assert after == expected[STEPS - len(after):]
    status = subprocess.run([sys.executable, "-m", "hpc_ddp.status", str(run_dir)],
                            cwd=REPO, env=slurm_env, capture_output=True, text=True,
                            timeout=120, check=False)
    assert "shrank: 4 -> 3 nodes (world size 4 -> 3)" in status.stdout, status.stdout
    if kind == "entry":
        return  # its loss is rank 0's part's own: not the global batch's
    # ... and the loss follows the uninterrupted run's, within rounding.
    later = [(s, v) for s, v in scalars_in(run_dir / "tb", "train/loss")["train/loss"]
             if s > STEPS - len(after)]
    assert later
    ref = reference["losses"]
    diffs = [abs(v - ref[s]) / abs(ref[s]) for s, v in later]
    print(f"{kind}: relative loss differences after the change: "
          f"{', '.join(f'{d:.1e}' for d in diffs)}")
    assert max(diffs) < LOSS_TOLERANCE, (later, ref)


def test_below_the_minimum_the_job_is_requeued_without_the_node_and_resumes_exactly(
        slurm_env: dict[str, str], tmp_path: Path) -> None:
    """``nodes=2 cluster.min_nodes=2``: a lost node leaves fewer than the minimum, so the job
    does what it does without the policy: the node excluded, the job requeued, the run resumed
    from its checkpoint at the exact data position (the steps trained again after the resume
    train on the samples they trained on before)."""
    from tests.cluster.test_fault_tolerance import finish_releasing_requeues

    run_dir = tmp_path / "run"
    job = submit(run_dir, tmp_path / "ids", slurm_env, False, ["nodes=2", "cluster.min_nodes=2"])
    wait_for_step(run_dir, 20)
    victim = json.loads((run_dir / "ranks" / "rank1.json").read_text())["host"]
    with node_down(victim, slurm_env):
        assert finish_releasing_requeues(job, run_dir, slurm_env) >= 1
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["requeues"] >= 1 and summary["excluded_nodes"] == [victim], summary
    assert summary["world_size"] == 2 and victim not in summary["hosts"]
    kinds = [e["kind"] for e in events.read(run_dir)]
    assert "requeue" in kinds and "shrink" not in kinds
    resumed = summary["resumed_from_step"]
    before, after = starts_of(tmp_path / "ids", settles=True)
    assert 8 <= resumed <= len(before) and len(after) == STEPS - resumed
    assert after[:len(before) - resumed] == before[resumed:]  # the same samples again
    assert all(sum(step.values()) == 32 for step in after)  # the global batch: 16 x 2


def test_a_shrunk_run_requeued_grows_back_to_its_nodes_in_the_same_order(
        reference: dict[str, Any], slurm_env: dict[str, str], tmp_path: Path) -> None:
    """Shrunk to 3 nodes, then requeued (USR2, as a preemption) once the lost node is back:
    the requeued job has its 4 nodes again, and every step of the three starts (4, 3, then 4
    nodes) trains on the uninterrupted run's samples."""
    from tests.cluster.test_fault_tolerance import (
        finish_releasing_requeues,
        progress_step,
        wait_for_event,
    )

    run_dir = tmp_path / "run"
    job = submit(run_dir, tmp_path / "ids", slurm_env, False, [])
    wait_for_step(run_dir, 20)
    victim = json.loads((run_dir / "ranks" / "rank1.json").read_text())["host"]
    with node_down(victim, slurm_env):
        deadline = time.monotonic() + 120
        while "shrink" not in [e["kind"] for e in events.read(run_dir)]:
            assert time.monotonic() < deadline, "the run did not shrink"
            time.sleep(0.5)
    # Training on 3 nodes (the ranks of the first start left their error files: not waited on):
    # its first step is the "recovered" event's (progress.json may still hold the first
    # start's last step, a later one than the shrunk start resumes from).
    shrunk_at = wait_for_event(run_dir, "recovered")["step"]
    deadline = time.monotonic() + 120
    while progress_step(run_dir) < shrunk_at + 4:
        assert time.monotonic() < deadline, "no step on 3 nodes"
        time.sleep(0.2)
    subprocess.run(["scancel", "--signal=USR2", "--full", job], env=slurm_env, check=True)
    assert finish_releasing_requeues(job, run_dir, slurm_env) >= 1
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 4 and len(summary["hosts"]) == 4, summary
    assert len(summary["shrinks"]) == 1 and summary["requeues"] >= 1
    expected = reference["steps"]
    first, middle, last = starts_of(tmp_path / "ids", settles=True)
    assert first == expected[:len(first)] and last == expected[STEPS - len(last):]
    assert any(expected[at:at + len(middle)] == middle for at in range(STEPS)), middle


def test_a_torchrun_style_script_shrinks_with_the_new_world_size(
        slurm_env: dict[str, str], tmp_path: Path) -> None:
    """The example's textbook script, unchanged, on 4 nodes with ``cluster.min_nodes=3``: a
    node lost, the same job starts it again on 3 nodes with the torchrun variables of 3
    ranks (a wrong WORLD_SIZE would hang its init_process_group), and it resumes from its
    own checkpoint to its last epoch."""
    saved, run_dir = tmp_path / "ckpt.pt", tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "hpc_ddp.submit", "cluster=slurm", "nodes=4",
                           "cluster.min_nodes=3", "script=train_ddp.py", f"run_dir={run_dir}",
                           "--", "--epochs", "6", "--checkpoint", str(saved)],
                          cwd=REPO / "examples" / "seqproject", env=slurm_env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    job = job_id_of(done.stdout)
    deadline = time.monotonic() + 240
    while not saved.exists():
        assert time.monotonic() < deadline, "the script never saved its first epoch"
        time.sleep(0.3)
    victim = lose_a_node_and_finish(run_dir, slurm_env, "script")
    assert_one_start_completed(job, slurm_env)
    summary = json.loads((run_dir / "summary.json").read_text())
    (shrink,) = summary["shrinks"]
    assert shrink["lost"] == [victim] and (shrink["world_before"], shrink["world_after"]) == (4, 3)
    import torch

    assert torch.load(saved)["epoch"] == 6
    out = (run_dir / "submitit" / job / f"{job}_0_log.out").read_text()
    assert "resumed at epoch" in out and "epoch 5 loss" in out
