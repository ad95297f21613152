"""Checkpoint writers killed by SIGKILL at random moments never leave an unusable latest.

    python -m tests.checkpoint_kills FOLDER KILLS SEED [sharded]   # prints one JSON line

One interpreter imports torch once; per kill it forks a child (cheap) that checkpoints a
2-rank world in the background as fast as it can (rank/services/ckpt_writer.py: both ranks' writers
on one store, a 1 MiB state; one rank's part, chosen at random, is the slowest to write),
SIGKILLs the child a random delay after it says (over a pipe) which step it starts from
(every other child only once it saved a set: the run goes on however slow the machine), and
checks that
``latest`` names a complete set: rank 0's file loads as data and holds its step, and each
rank's stream file of that step loads and holds the same step. Each child starts from the
step after the latest, so the run goes on across kills as a requeued job would: ``starts``
holds the step each child started from, which the tests hold to the latest before it (a
check of the resuming that does not depend on how fast this machine is today). Used by
tests/unit/test_checkpoint.py (a few kills here) and tests/cluster/test_checkpoints_and_secrets.py
(one srun step per node, 50+ kills in all). ``sharded``: one rank saving its tensors in the
sharded format (DCP, rank/services/dcp_files.py) in the background, staged as an
asynchronous save is; ``latest`` must name a whole folder that reads back as data.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any


def _started(pipe: int, step: int) -> None:
    """Tell the parent the step this child starts from: its random delay counts from here,
    so a loaded machine's slow fork and set-up do not eat the time the child writes in."""
    os.write(pipe, f"{step}\n".encode())
    os.close(pipe)


def _child(folder: Path, slow_rank: int, pipe: int) -> None:
    import torch
    import torch.distributed as dist

    from hpc_ddp.rank.services import checkpoint
    from hpc_ddp.rank.services.ckpt_writer import CheckpointWriter

    store = dist.HashStore()
    writers = [CheckpointWriter(folder, r, 2, keep=2, store=store, timeout_s=60)
               for r in (0, 1)]
    step = (checkpoint.latest_step(folder) or 0) + 1
    _started(pipe, step)
    weights = torch.randn(256, 1024)  # 1 MiB: a write takes long enough to be hit
    ballast = torch.zeros(2048, 1024)  # 8 MiB in the slow rank's part: it finishes last
    while True:
        weights.fill_(float(step))
        for rank, writer in enumerate(writers):
            streams: dict[str, Any] = {"step": step, "torch": torch.get_rng_state()}
            if rank == slow_rank:
                streams["ballast"] = ballast
            writer.save(step, {"step": step, "w": weights} if rank == 0 else None, streams)
        step += 1


def _sharded_child(folder: Path, pipe: int) -> None:
    import torch

    from hpc_ddp.rank.services import checkpoint, tensor_tree
    from hpc_ddp.rank.services.ckpt_writer import CheckpointWriter

    writer = CheckpointWriter(folder, 0, 1, keep=2, timeout_s=60, background=True)
    step = (checkpoint.latest_step(folder) or 0) + 1
    _started(pipe, step)
    weights = torch.randn(1024, 1024)  # 4 MiB of tensors a save
    while True:
        weights.fill_(float(step))
        plain, tensors = tensor_tree.split({"step": step, "w": weights})
        writer.save(step, plain, {"step": step, "torch": torch.get_rng_state()}, shards=tensors)
        step += 1


def check(folder: Path, ranks: int = 2) -> dict[str, Any]:
    """What the latest set holds; ``problem`` says what is wrong with it, if anything."""
    from hpc_ddp.rank.services import checkpoint

    step = checkpoint.latest_step(folder)
    if step is None:
        path = checkpoint.latest_path(folder)  # a kill before the first set: none, not a bad one
        return {"step": None, "problem": None if path is None else f"bad pointer {path}"}
    state = checkpoint.load_latest(folder)
    if state is None or state["step"] != step or not bool((state["w"] == step).all()):
        return {"step": step, "problem": f"rank 0's file of step {step} holds another state"}
    for rank in range(ranks):
        streams = checkpoint.load_streams(folder, rank, step)
        if streams is None or streams["step"] != step:
            return {"step": step, "problem": f"rank {rank}'s streams of step {step} missing"}
    return {"step": step, "problem": None}


def _saved(folder: Path, step: int, deadline_s: float) -> bool:
    """Wait until a set of ``step`` or later is the latest: every other kill comes only after
    its child saved one, so the run goes on however slow the disk and the cores are today."""
    from hpc_ddp.rank.services import checkpoint

    deadline = time.monotonic() + deadline_s
    while (checkpoint.latest_step(folder) or 0) < step:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def kills(folder: Path, count: int, seed: int, sharded: bool = False) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)  # no thread pool to inherit half-made into the forked children
    if sharded:  # imported once here, not in every child before its first save
        import torch.distributed.checkpoint  # noqa: F401
        import torch.distributed.checkpoint.staging  # noqa: F401

        from hpc_ddp.rank.services import ckpt_writer, dcp_read  # noqa: F401
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    steps: list[int | None] = []
    starts: list[int] = []
    problems: list[str] = []
    for _ in range(count):
        read_end, write_end = os.pipe()
        slow_rank = rng.randrange(2)
        pid = os.fork()
        if pid == 0:
            try:
                os.close(read_end)
                if sharded:
                    _sharded_child(folder, write_end)
                _child(folder, slow_rank, write_end)
            finally:
                os._exit(1)
        os.close(write_end)
        with os.fdopen(read_end) as said:
            line = said.readline()  # "" when the child died before it started
        if line:
            starts.append(int(line))
            if len(starts) % 2 == 0 and not _saved(folder, starts[-1], deadline_s=120):
                problems.append(f"no set of step {starts[-1]} was saved in 120 s")
            time.sleep(rng.uniform(0.05, 0.5))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        if not line:
            problems.append("a writer child died before it started (see its stderr)")
            break
        found = check(folder, ranks=1 if sharded else 2)
        steps.append(found["step"])
        if found["problem"]:
            problems.append(found["problem"])
    return {"host": os.uname().nodename, "kills": len(steps), "steps": steps,
            "starts": starts, "problems": problems}


def resumed_each_time(result: dict[str, Any]) -> bool:
    """Each child started from the step after the latest its predecessor left (the first
    from step 1): the run went on across every kill, as a requeued job does."""
    before = [0] + [s or 0 for s in result["steps"][:-1]]
    return bool(result["starts"]) and result["starts"] == [b + 1 for b in before]


if __name__ == "__main__":
    where, n, seed = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    print(json.dumps(kills(where, n, seed, sharded=sys.argv[4:5] == ["sharded"])), flush=True)
