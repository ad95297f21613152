"""Warm rank processes for the combination matrix (tests/integration/test_matrix.py).

A run of the matrix is planned as ``python -m hpc_ddp.submit`` plans it (``api.plan``: compose,
validate, check the run dir, write config.yaml) and then run by the real rank path
(``rank.main.task.run``: join, rendezvous, process group, train, checkpoint, summary) in
processes started once for the whole matrix: each row pays its own training, not an
interpreter and a torch import per rank. Only submitit's start of the processes is left out;
every other test of a local run goes through it.

The ranks get torchrun's variables (a fresh port and run id per run), as a rank started by
torchrun would; on a GPU machine (``device="cuda"``) one rank on the GPU with NCCL.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

# A run that takes longer than this has hung (a rank waiting for one that failed): the pool
# is started anew, so the next row does not inherit it.
RUN_TIMEOUT_S = 300


def _serve(rank: int, world: int, jobs: Connection) -> None:
    """One rank: run each job it is sent, answer ("ok", summary) or ("error", traceback)."""
    from hpc_ddp.config.compose import from_yaml
    from hpc_ddp.rank.main import task
    from hpc_ddp.rundir import RunDir

    baseline = dict(os.environ)
    while True:
        job = jobs.recv()
        if job is None:
            return
        os.environ.clear()
        os.environ.update({**baseline, **job["environ"], "RANK": str(rank),
                           "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                           "LOCAL_WORLD_SIZE": str(world)})
        try:
            summary = task.run(from_yaml(job["config"]), RunDir(Path(job["run_dir"])),
                               os.environ)
            jobs.send(("ok", summary))
        except BaseException:  # noqa: B036 (a SystemExit of the rank path is a result too)
            jobs.send(("error", traceback.format_exc()))


def _stopped(error: str) -> bool:
    """A rank's answer to a stop the ranks agreed on: its traceback's last line."""
    last = error.strip().splitlines()[-1] if error.strip() else ""
    return last == "SystemExit: 0" or last.startswith(
        "hpc_ddp.rank.join.joined.RunStopped: stopped at step")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Outcome:
    ok: bool
    summary: dict[str, Any] | None
    errors: list[str]


class RankPool:
    """``world`` rank processes, kept between runs."""

    def __init__(self, world: int, environ: dict[str, str] | None = None) -> None:
        self.world = world
        self.environ = dict(environ or {})
        self._start()

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.pipes: list[Connection] = []
        self.procs: list[Any] = []
        for rank in range(self.world):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(rank, self.world, theirs), daemon=True)
            proc.start()
            self.pipes.append(mine)
            self.procs.append(proc)
        self.runs = 0

    def close(self) -> None:
        for pipe, proc in zip(self.pipes, self.procs, strict=True):
            try:
                pipe.send(None)
            except OSError:
                pass
            proc.join(10)
            if proc.is_alive():
                proc.kill()

    def restart(self) -> None:
        for proc in self.procs:
            proc.kill()
        self._start()

    def run(self, overrides: Sequence[str], run_dir: Path, cwd: Path | None = None) -> Outcome:
        """Plan ``overrides`` as the submit command does (api.plan), then run it on every
        rank."""
        from hpc_ddp import api
        from hpc_ddp.inputs.run_dir import write_run_config

        given = [*overrides, "cluster=local", f"cluster.tasks_per_node={self.world}"]
        plan = api.plan([*given, f"run_dir={run_dir}"], cwd=cwd)
        config = write_run_config(plan.run_dir, plan.cfg, plan.overrides)
        self.runs += 1
        environ = {**self.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                   "TORCHELASTIC_RUN_ID": f"matrix{os.getpid()}-{self.runs}"}
        for pipe in self.pipes:
            pipe.send({"config": config, "run_dir": str(plan.run_dir.root),
                       "environ": environ})
        answers: list[tuple[str, Any]] = []
        for pipe in self.pipes:
            if not pipe.poll(RUN_TIMEOUT_S):
                self.restart()
                return Outcome(False, None, [f"no answer within {RUN_TIMEOUT_S} s; "
                                             "the pool was restarted"])
            answers.append(pipe.recv())
        errors = [text for kind, text in answers if kind == "error"]
        # A rank that failed may leave the others' state unusable: the pool starts anew (two
        # interpreters importing torch: seconds). A stop the ranks agreed on (rank 0's
        # RunStopped, the others' SystemExit(0): every row's stopped run) ends as a finished
        # run does, its process group destroyed, and the ranks go on to the resume.
        if errors and not all(_stopped(text) for text in errors):
            self.restart()
        return Outcome(not errors, answers[0][1] if not errors else None, errors)
