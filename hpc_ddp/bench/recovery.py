"""What a failure costs: seconds from a rank killed (or a node lost) to the first training
step after it, restarted in place vs requeued.

    python -m hpc_ddp.bench recovery                  # SIGKILL of one rank, median of 3 each
    python -m hpc_ddp.bench recovery --node-loss      # + a node set DOWN, with/without a spare,
                                                      #   and shrunk past it (min_nodes)
    python -m hpc_ddp.bench recovery --node-loss-only --rounds 3   # only the node losses

Runs real jobs on the Slurm cluster the environment points at (``sbatch`` on PATH; the test
cluster: ``python -m hpc_ddp.testcluster up``, docs/testcluster.md). Each run trains the
built-in model on 2 nodes; at step 40 one rank's training process is killed (its record in
``ranks/`` names the pid and host: signalled directly when it runs on this machine, through
``srun --overlap`` otherwise). The figure is the run's own record of what the failure cost
(summary.json ``failures[0].seconds_to_first_step``: from the failure to the first step
after it, docs/fault-tolerance.md#what-a-failure-cost). "In place" is the default
(``cluster.restarts_in_place=3``); "requeue" is ``cluster.restarts_in_place=0``, which
waits for Slurm to start the requeued job (its begin time is ~2 minutes away: Slurm's own
delay, part of what a requeue costs). ``--node-loss`` sets rank 1's node DOWN (it needs the
right to: an administrator's, or the test cluster) and brings it back after: with a spare
node (the same job), without one (a requeue without the node), and with
``cluster.min_nodes=1`` (the same job goes on with the one node left,
docs/fault-tolerance.md#shrinking-past-a-lost-node); their figure runs from the moment the
node is set DOWN (to the first step after it, the run's ``recovered`` event).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hpc_ddp.errors import USAGE_EXIT_CODE, UserError

# A run long enough to be killed at step 40 and resume: ~0.07 s a step on the test cluster.
ARGS = ["cluster=slurm", "nodes=2", "trainer.max_steps=200", "trainer.batch_size=128",
        "data.train_size=2048", "data.eval_size=256", "trainer.checkpoint_interval=10",
        "trainer.log_interval=10", "trainer.eval_interval=100",
        "trainer.collective_timeout_s=30"]
KILL_AT_STEP = 40


def _step(run_dir: Path) -> int:
    try:
        return int(json.loads((run_dir / "progress.json").read_text())["step"])
    except (OSError, ValueError, KeyError):
        return 0


def _record(run_dir: Path, rank: int) -> dict[str, Any]:
    return dict(json.loads((run_dir / "ranks" / f"rank{rank}.json").read_text()))


def _submit(run_dir: Path, extra: Sequence[str]) -> str:
    done = subprocess.run([sys.executable, "-m", "hpc_ddp.submit", *ARGS, *extra,
                           f"run_dir={run_dir}"], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"submit failed: {done.stderr.strip()[-2000:]}")
    job = json.loads((run_dir / "job.json").read_text())["job_id"]
    return str(job)


def _wait(what: str, ready: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _kill(record: dict[str, Any], job: str) -> None:
    """SIGKILL the rank's training process: directly when it is this machine's, else on its
    node through a step that overlaps the job."""
    pid = int(record["pid"])
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"hpc_ddp" in cmdline:
            os.kill(pid, signal.SIGKILL)
            return
    except OSError:
        pass
    subprocess.run(["srun", f"--jobid={job}", "--overlap", "-N1", "-n1",
                    f"--nodelist={record['host']}", "kill", "-KILL", str(pid)],
                   capture_output=True, check=False, timeout=60)


def _finished(run_dir: Path, job: str) -> bool:
    gone = subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True,
                          check=False).stdout.strip() == ""
    return gone and (run_dir / "summary.json").exists()


def one_run(root: Path, label: str, extra: Sequence[str], node_loss: bool) -> dict[str, Any]:
    """One run: killed (or its rank 1's node lost) at step 40; what the failure cost."""
    run_dir = root / label
    job = _submit(run_dir, extra)
    _wait(f"step {KILL_AT_STEP} of job {job}", lambda: _step(run_dir) >= KILL_AT_STEP, 600)
    record = _record(run_dir, 1)
    down_at = time.time()
    if node_loss:
        subprocess.run(["scontrol", "update", f"nodename={record['host']}", "state=down",
                        "reason=hpc_ddp-bench"], check=True, capture_output=True)
    else:
        _kill(record, job)
    try:
        _wait(f"job {job} to finish", lambda: _finished(run_dir, job), 900)
    finally:
        if node_loss:
            subprocess.run(["scontrol", "update", f"nodename={record['host']}",
                            "state=resume"], capture_output=True, check=False)
    summary = json.loads((run_dir / "summary.json").read_text())
    failure = (summary.get("failures") or [{}])[0]
    seconds = failure.get("seconds_to_first_step")
    if node_loss:  # from the node set DOWN (Slurm's word) to the first step after it
        from hpc_ddp import events  # deferred (start-up): events

        back = [e["time"] for e in events.read(run_dir)
                if e.get("kind") == events.RECOVERED and e.get("time", 0) > down_at]
        seconds = round(back[0] - down_at, 3) if back else None
    return {"label": label, "job": job, "seconds": seconds,
            "steps_lost": failure.get("steps_lost"), "by": failure.get("recovered_by"),
            "restarts_in_place": summary.get("restarts_in_place"),
            "requeues": summary.get("requeues")}


def cases(node_loss: bool, kills: bool = True) -> list[tuple[str, list[str], bool]]:
    """(label, extra overrides, node loss?) of each kind of run measured."""
    found = [("in place", [], False), ("requeue", ["cluster.restarts_in_place=0"], False)]
    found = found if kills else []
    if node_loss:
        found += [("node lost, 1 spare", ["cluster.spare_nodes=1"], True),
                  ("node lost, no spare", [], True),
                  ("node lost, shrink", ["cluster.min_nodes=1"], True)]
    return found


def report(results: dict[str, list[dict[str, Any]]]) -> str:
    """The table: median seconds to the first step after the failure, per kind, and the
    ratio of the requeue's to the restart in place's."""
    lines = ["kind                  runs  median s  each (s)                 steps lost"]
    medians: dict[str, float] = {}
    for label, runs in results.items():
        secs = [r["seconds"] for r in runs if isinstance(r["seconds"], int | float)]
        median = statistics.median(secs) if secs else float("nan")
        medians[label] = median
        each = ", ".join(f"{s:.1f}" for s in secs) or "-"
        lost = ", ".join(str(r["steps_lost"]) for r in runs)
        lines.append(f"{label:<21} {len(runs):>4}  {median:>8.1f}  {each:<24} {lost}")
    if medians.get("in place") and medians.get("requeue"):
        lines.append(f"requeue / in place: {medians['requeue'] / medians['in place']:.1f}x")
    if medians.get("node lost, shrink") and medians.get("node lost, no spare"):
        lines.append("node lost, requeue / shrink: "
                     f"{medians['node lost, no spare'] / medians['node lost, shrink']:.1f}x")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpc_ddp.bench recovery",
                                     description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--rounds", type=int, default=3, help="runs per kind (median)")
    parser.add_argument("--node-loss", action="store_true",
                        help="also set a node DOWN (needs the right to), with/without a spare")
    parser.add_argument("--node-loss-only", action="store_true",
                        help="only the node losses (no killed rank)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args(argv)
    try:
        if args.rounds < 1:
            raise UserError("--rounds", args.rounds, "must be 1 or more.", "e.g. --rounds 3.")
        if not any((Path(d) / "sbatch").exists() for d in os.environ.get("PATH", "").split(":")):
            raise UserError("sbatch", "(not found)", "this benchmark runs Slurm jobs.",
                            "run it where sbatch works (the test cluster: python -m "
                            "hpc_ddp.testcluster up, then its env line).")
    except UserError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return USAGE_EXIT_CODE
    results: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="hpc_ddp_recovery_", dir=os.getcwd()) as tmp:
        for label, extra, node_loss in cases(args.node_loss or args.node_loss_only,
                                             not args.node_loss_only):
            rounds = args.rounds
            for i in range(rounds):
                print(f"{label}: run {i + 1} of {rounds} ...", file=sys.stderr, flush=True)
                done = one_run(Path(tmp), f"{label.replace(' ', '_').replace(',', '')}_{i}",
                               extra, node_loss)
                print(f"  {done['seconds']} s to the first step after it ({done['by']})",
                      file=sys.stderr, flush=True)
                results.setdefault(label, []).append(done)
    print(report(results))
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
