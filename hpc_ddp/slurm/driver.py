"""The job's step, run again on the healthy nodes when a node of the allocation is lost.

A job submitted with ``--no-kill`` survives the loss of a node (slurmd gone, the node set
DOWN): Slurm takes the node out of the job and ends the tasks on it, the other tasks go on
(https://slurm.schedmd.com/sbatch.html#OPT_no-kill). Their supervisors find a supervisor
that never reports, or rank 0's store gone, and end the step (supervise/generations.py,
LOST). This process runs in the batch script in place of submitit's ``srun`` (a shell
function of that name, launch/slurm.py) and starts the step on ``cluster.nodes`` of the
allocation's nodes; when the step ends because nodes were lost, it starts it again in the
same job on the nodes left, a spare among them (``cluster.spare_nodes``), within
``cluster.restarts_in_place``; the ranks resume from the latest checkpoint. With no spare
left, and ``cluster.min_nodes`` set, it starts the step on fewer nodes (a shrink, never below
the minimum): the ranks resume with the smaller world size. Without enough nodes left it adds
the lost ones to the job's excluded nodes and requeues the job, so the requeued job never
lands on them (and has its full node count again). The batch host is the last node it gives
the step, so a spare is the node this process runs on: a lost worker node never takes the
driver with it.

Its cost to slurmctld: one ``squeue`` per step that failed (which nodes the job still has),
and on a requeue two ``scontrol`` calls (requeue, update). Nothing per rank.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_ddp import events, hostlist
from hpc_ddp.rank.contract import DRIVEN_ENV

log = logging.getLogger("hpc_ddp.driver")


@dataclass(frozen=True)
class Plan:
    """What the driver does after a step: ``what`` is "done", "relaunch", "requeue" or
    "end"; ``nodes``: the step's next nodes (relaunch) or the nodes to exclude (requeue)."""

    what: str
    nodes: tuple[str, ...] = ()
    lost: tuple[str, ...] = ()


def step_nodes(allocated: Sequence[str], lost: Sequence[str], batch_host: str,
               wanted: int, least: int | None = None) -> list[str] | None:
    """The nodes of the next step: ``wanted`` of the allocation's healthy ones, the batch
    host last (it stays a spare while there is another), or as many as are left down to
    ``least`` (a shrink; default ``wanted``); None when too few are left."""
    healthy = [n for n in allocated if n not in lost]
    ordered = [n for n in healthy if n != batch_host] + [n for n in healthy if n == batch_host]
    return ordered[:wanted] if len(ordered) >= (least or wanted) else None


def plan(code: int, used: Sequence[str], still: Sequence[str] | None, lost: Sequence[str],
         allocated: Sequence[str], batch_host: str, wanted: int, relaunches: int,
         budget: int, deferred: bool = False, least: int | None = None) -> Plan:
    """Pure: what to do after a step that used ``used`` and ended with ``code``; ``still``:
    the job's nodes now (None: unknown); ``deferred``: the ranks left the step's failure to
    this driver (a supervisor stopped answering). A step that lost no node ended as its
    ranks decided (done, failed, requeued by them), unless they deferred: then it starts
    again on the same nodes (a supervisor lost on a healthy node), within the budget.
    ``least``: the fewest nodes a step may shrink to when no spare is left
    (``cluster.min_nodes``; None: the step never shrinks)."""
    if code == 0:
        return Plan("done")
    if still is None:  # the job is not running any more (its ranks requeued it) or unknown
        return Plan("end")
    gone = tuple(n for n in used if n not in still)
    if not gone:
        if not deferred:
            return Plan("end")
        if relaunches >= budget:
            return Plan("requeue")
        return Plan("relaunch", tuple(used))
    every_lost = tuple(dict.fromkeys([*lost, *gone]))
    nxt = step_nodes(allocated, every_lost, batch_host, wanted, least)
    if nxt is None or relaunches >= budget:
        return Plan("requeue", every_lost, gone)
    return Plan("relaunch", tuple(nxt), gone)


def deferred_failure(seen: Sequence[dict[str, Any]], job: str) -> bool:
    """The ranks' last failure in ``job`` was left to this driver and nothing acted on it
    since (events.jsonl)."""
    for e in reversed(seen):
        if e.get("job") not in (None, job):
            continue
        if e.get("kind") in (events.REQUEUE, events.RESTART_IN_PLACE, events.RECOVERED,
                             events.NODE_LOST):
            return False
        if e.get("kind") == events.FAILURE:
            return bool(e.get("deferred"))
    return False


def job_nodes(job: str, environ: Mapping[str, str]) -> list[str] | None:
    """The nodes the job has now (one squeue); None when it cannot be read, or the job is
    no longer running (its ranks requeued it: nothing for the driver to do). Asked here,
    in the batch script, never through a container's relay."""
    from hpc_ddp.slurm import relay, requeue  # deferred (start-up): slurm.requeue

    return requeue.job_nodes(job, {k: v for k, v in environ.items() if k != relay.RELAY_ENV})


def run_step(nodes: Sequence[str], tasks_per_node: int, srun_args: Sequence[str],
             environ: Mapping[str, str], relaunch: int) -> int:
    """``srun`` on ``nodes`` (--no-kill: a node lost ends its own tasks only), the logs
    appended after the first step; its exit code."""
    argv = ["srun", "--no-kill", f"--nodes={len(nodes)}",
            f"--ntasks={len(nodes) * tasks_per_node}", f"--ntasks-per-node={tasks_per_node}",
            f"--nodelist={','.join(nodes)}", *(["--open-mode=append"] if relaunch else []),
            *srun_args]
    env = {**environ, DRIVEN_ENV: str(relaunch)}
    proc = subprocess.Popen(argv, env=env)
    while True:
        try:
            return proc.wait()
        except KeyboardInterrupt:  # srun got it too and ends the step
            continue


def requeue_without(job: str, nodes: Sequence[str], environ: Mapping[str, str]) -> str | None:
    """Requeue the job, then exclude ``nodes`` from it; None once it is requeued, else
    Slurm's answer. A running job's ExcNodeList cannot be changed ("no longer pending"), a
    requeued one's can, and it waits for its begin time (about two minutes) before it may
    start. The requeue ends the batch step: SIGTERM to every process of it, SIGKILL after
    KillWait (https://slurm.schedmd.com/slurm.conf.html#OPT_KillWait). This process goes on
    (its handler waits), and the ``scontrol update`` it starts ignores SIGTERM (an ignored
    signal stays ignored across exec): the update, started while the requeue's SIGTERM
    arrives, was killed by it and the requeued job landed on the lost node again. If this
    process is killed before the exclusion, the job is requeued without it, never lost in a
    hold."""
    env = dict(environ)
    for argv in (["scontrol", "requeue", job],
                 *([["scontrol", "update", f"JobId={job}", f"ExcNodeList={','.join(nodes)}"]]
                   if nodes else [])):
        try:
            with _ignoring(signal.SIGTERM):
                done = subprocess.run(argv, env=env, capture_output=True, text=True,
                                      timeout=60, check=False)
            problem = None if done.returncode == 0 else (
                (done.stderr or done.stdout).strip() or f"exit code {done.returncode}")
        except (OSError, subprocess.TimeoutExpired) as exc:
            problem = str(exc)
        if problem and argv[1] == "requeue":
            return f"{' '.join(argv)}: {problem}"
        if problem:
            log.error("job %s is requeued but %s failed: %s", job, " ".join(argv), problem)
    return None


@contextlib.contextmanager
def _ignoring(signum: int) -> Iterator[None]:
    """``signum`` ignored by this process, and so by the processes it starts, until the end
    of the block; then its handler again."""
    before = signal.signal(signum, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signum, before)


def _note(run_root: Path | None, event: dict[str, Any]) -> None:
    if run_root is not None:
        events.append(run_root, event)


def run_root_of(run_dir: str | None, points: str | None,
                environ: Mapping[str, str]) -> Path | None:
    """The run dir whose events.jsonl this job's step reads and writes: ``run_dir``, or in a
    sweep's job array (``run_dir`` the sweep's folder, ``points`` its tasks' run dirs in
    task order) the point of this array task, where its ranks write theirs."""
    if not run_dir:
        return None
    if not points:
        return Path(run_dir)
    task = environ.get("SLURM_ARRAY_TASK_ID", "")
    names = points.split(",")
    if not task.isdigit() or int(task) >= len(names):
        log.error("array task %r has no point among the %d of --points: its events are not "
                  "written", task, len(names))
        return None
    return Path(run_dir) / names[int(task)]


def drive(args: argparse.Namespace, srun_args: list[str], environ: Mapping[str, str]) -> int:
    job = environ["SLURM_JOB_ID"]
    allocated = hostlist.expand(environ["SLURM_JOB_NODELIST"])
    batch_host = environ.get("SLURMD_NODENAME") or allocated[0]
    run_root = run_root_of(args.run_dir, args.points, environ)
    lost: list[str] = []
    relaunches = 0
    nodes = step_nodes(allocated, lost, batch_host, args.nodes, args.min_nodes)
    if nodes is None:
        print(f"error: the job has {len(allocated)} nodes, fewer than the {args.nodes} its step "
              "needs", file=sys.stderr)
        return 2
    while True:
        code = run_step(nodes, args.tasks_per_node, srun_args, environ, relaunches)
        still = job_nodes(job, environ) if code != 0 else None
        deferred = code != 0 and run_root is not None and deferred_failure(
            events.read(run_root), job)
        decided = plan(code, nodes, still, lost, allocated, batch_host, args.nodes,
                       relaunches, args.budget, deferred, args.min_nodes)
        if decided.what in ("done", "end"):
            return code
        lost = [*lost, *decided.lost]
        record: dict[str, Any] = {"job": job, "attempt": int(environ.get(
            "SLURM_RESTART_COUNT", "0") or 0)}
        why = (f"node(s) {','.join(decided.lost)} lost" if decided.lost
               else "a supervisor stopped answering")
        if decided.lost:
            _note(run_root, {"kind": events.NODE_LOST, **record, "nodes": list(decided.lost)})
        if decided.what == "relaunch":
            relaunches += 1
            if len(decided.nodes) != len(nodes):  # a shrink (or, never today, a growth)
                _note(run_root, {"kind": events.SHRINK, **record, "lost": list(decided.lost),
                                 "nodes_before": len(nodes), "nodes_after": len(decided.nodes),
                                 "world_before": len(nodes) * args.tasks_per_node,
                                 "world_after": len(decided.nodes) * args.tasks_per_node})
                log.warning("%s and no spare node is left: going on with %d of %d nodes "
                            "(cluster.min_nodes=%d)", why, len(decided.nodes), args.nodes,
                            args.min_nodes)
            nodes = list(decided.nodes)
            log.warning("%s: the step starts again on %s (restart %d of at most %d in this "
                        "job)", why, ",".join(nodes), relaunches, args.budget)
            _note(run_root, {"kind": events.RESTART_IN_PLACE, **record, "cause": why,
                             "on": nodes})
            continue
        if lost:
            _note(run_root, {"kind": events.NODES_EXCLUDED, **record, "nodes": lost})
        log.warning("%s and no spare node or restart is left: requeueing job %s%s", why, job,
                    f" without {','.join(lost)}" if lost else "")
        problem = requeue_without(job, lost, environ)
        if problem:
            log.error("could not requeue job %s: %s", job, problem)
            return code
        _note(run_root, {"kind": events.REQUEUE, **record, "cause": why})
        return code


def _waits(signum: int, frame: Any) -> None:
    """A signal to the batch step: srun has it too; this process goes on waiting for srun."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpc_ddp.slurm.driver",
                                     description="(used by hpc_ddp's Slurm jobs) run the "
                                     "job's step; again on the healthy nodes after a node "
                                     "is lost.")
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--tasks-per-node", type=int, required=True)
    parser.add_argument("--budget", type=int, required=True)
    parser.add_argument("--min-nodes", type=int, default=None,
                        help="shrink to no fewer nodes than this when no spare is left")
    parser.add_argument("--run-dir", default=None, help="where events.jsonl is; with --points "
                        "a sweep's folder")
    parser.add_argument("--points", default=None, help="a sweep's job array: the run dirs of "
                        "its tasks in task order, under --run-dir, comma-separated")
    parser.add_argument("srun_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s hpc_ddp driver: %(message)s")
    srun_args = args.srun_args[1:] if args.srun_args[:1] == ["--"] else args.srun_args
    # slurmstepd signals every process of the batch step: srun acts on them (it passes them to
    # the tasks); this process only waits for it. A handler, not SIG_IGN, which srun would
    # inherit.
    for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, _waits)
    return drive(args, srun_args, os.environ)


if __name__ == "__main__":
    sys.exit(main())
