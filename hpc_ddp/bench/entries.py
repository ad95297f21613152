"""What running your own code through hpc_ddp costs (docs/your-code.md, docs/performance.md).

    python -m hpc_ddp.bench entries                        # function entry, 2 local ranks
    python -m hpc_ddp.bench entries --slurm-nodes 4        # + script= vs bare srun, on Slurm

- function entry: a tiny-CNN DDP step with the context's per-step calls (``should_stop()``
  every step, ``log()`` every 10) against the same step without them, in the same ranks.
  The overhead is the time spent inside those calls per step, in % of the bare step
  (target: at most 1 %); the interleaved rounds' step times are shown too, with their
  spread, which on a busy machine is larger than the overhead itself.
- script: hpc_ddp/bench/ddp_script.py under ``python -m hpc_ddp.submit script=...`` against
  the same script under a bare ``srun`` with the torchrun variables set by hand, interleaved
  rounds on the same nodes; its own samples/s, the ratio (target: at least 0.99).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import hpc_ddp
from hpc_ddp.errors import USAGE_EXIT_CODE, UserError

SCRIPT = Path(__file__).with_name("ddp_script.py")


def overhead_rank(ctx: Any) -> dict[str, Any]:
    """The function entry measuring itself: bare steps and steps with the context's calls."""
    # deferred: the typed schemas, torch; start-up: data.synthetic
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hpc_ddp.data.synthetic import make_split
    from hpc_ddp.trainer.models import builtin_model

    steps, rounds = int(ctx.app["steps"]), int(ctx.app["rounds"])
    torch.manual_seed(0)
    model = DDP(builtin_model("tiny_cnn", 10, 32).to(ctx.device))
    data = make_split(0, 512, 2.5, 0)
    batches = [(data.images[i:i + 64].float().to(ctx.device) / 255,
                data.labels[i:i + 64].to(ctx.device)) for i in range(0, 512, 64)]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    counter = [0]
    inside = [0.0]  # seconds spent in the context's calls

    def leg(with_context: bool) -> float:
        dist.barrier()
        started = time.perf_counter()
        for _ in range(steps):
            x, y = batches[counter[0] % len(batches)]
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            counter[0] += 1
            if with_context:
                entered = time.perf_counter()
                if counter[0] % 10 == 0:
                    ctx.log({"loss": loss.item()}, counter[0])
                ctx.should_stop()
                inside[0] += time.perf_counter() - entered
        if ctx.device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        return 1000 * (time.perf_counter() - started) / steps

    leg(False)  # warm-up: both legs once, so TensorBoard's writer thread (made at the first
    leg(True)   # log) is there for every timed leg, and only the per-step calls differ
    bare: list[float] = []
    entry: list[float] = []
    inside[0] = 0.0
    for r in range(rounds):  # each leg first in half of the rounds
        for with_context in ((False, True) if r % 2 == 0 else (True, False)):
            (entry if with_context else bare).append(leg(with_context))
    b, e = statistics.median(bare), statistics.median(entry)
    calls_ms = 1000 * inside[0] / (rounds * steps)
    spread = 100 * (max(bare) - min(bare)) / b
    return {"bare_step_ms": b, "entry_step_ms": e, "calls_ms_per_step": calls_ms,
            "overhead_pct": 100 * calls_ms / b, "ab_difference_pct": 100 * (e - b) / b,
            "bare_spread_pct": spread, "rounds": rounds, "steps": steps}


def function_entry(rounds: int, steps: int, extra: Sequence[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="hpc_ddp_bench_entry_") as tmp:
        run = hpc_ddp.submit(["cluster=local", f"run_dir={tmp}/run",
                              f"+app.steps={steps}", f"+app.rounds={rounds}", *extra],
                             entry=overhead_rank)
        summary = run.wait(progress=False)
    return dict(summary["result"])


def script_vs_srun(nodes: int, rounds: int, steps: int, extra: Sequence[str]) -> dict[str, Any]:
    """Interleaved rounds of the script under script= and under a bare srun (Slurm). Both
    legs get this command's environment (sbatch exports it), with one intra-op thread per
    rank unless OMP_NUM_THREADS says otherwise: several ranks on a node would otherwise
    oversubscribe its cores and bury the comparison in noise."""

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    legs: dict[str, list[float]] = {"script=": [], "bare srun": []}
    with tempfile.TemporaryDirectory(prefix="hpc_ddp_bench_script_", dir=Path.cwd()) as tmp:
        for r in range(rounds):
            order = ("script=", "bare srun") if r % 2 == 0 else ("bare srun", "script=")
            for name in order:
                out = Path(tmp) / f"{r}-{name.split()[0].rstrip('=')}.json"
                if name == "script=":
                    _run_script_leg(nodes, steps, out, Path(tmp) / f"run{r}", extra)
                else:
                    _run_srun_leg(nodes, steps, out)
                legs[name].append(json.loads(out.read_text())["samples_per_s"])
                print(f"  round {r + 1}/{rounds} {name:<10} {legs[name][-1]:9.0f} samples/s",
                      file=sys.stderr, flush=True)
    return {**paired(legs["script="], legs["bare srun"]), "rounds": rounds, "nodes": nodes,
            "legs": legs}


def paired(ours: Sequence[float], bare: Sequence[float]) -> dict[str, float]:
    """Interleaved rounds, compared: each leg's median and spread ((max - min) / median), and
    the ratio as the median of the per-round ratios (a round's two legs ran back to back, so
    the machine's changing load falls on both), with the lowest and highest round's."""
    ratios = [o / b for o, b in zip(ours, bare, strict=True)]

    def spread(values: Sequence[float]) -> float:
        return (max(values) - min(values)) / statistics.median(values)

    return {"script_samples_per_s": statistics.median(ours),
            "srun_samples_per_s": statistics.median(bare), "ratio": statistics.median(ratios),
            "ratio_min": min(ratios), "ratio_max": max(ratios),
            "script_spread": spread(ours), "srun_spread": spread(bare)}


def _run_script_leg(nodes: int, steps: int, out: Path, run_dir: Path,
                    extra: Sequence[str]) -> None:
    done = subprocess.run([sys.executable, "-m", "hpc_ddp.submit", "cluster=slurm",
                           f"nodes={nodes}", f"script={SCRIPT}", f"run_dir={run_dir}",
                           "wait=true", *extra, "--", "--steps", str(steps), "--out", str(out)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the script= leg failed: {(done.stdout + done.stderr)[-800:]}")


def _run_srun_leg(nodes: int, steps: int, out: Path) -> None:
    """The torchrun variables by hand, as users write them in sbatch files."""
    inner = (f"RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS "
             f"LOCAL_WORLD_SIZE=1 MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST "
             f"| head -n1) MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000)) "
             f"exec {shlex.quote(sys.executable)} {shlex.quote(str(SCRIPT))} "
             f"--steps {steps} --out {shlex.quote(str(out))}")
    wrap = f"srun bash -c {shlex.quote(inner)}"
    done = subprocess.run(["sbatch", "--parsable", f"-N{nodes}", "--ntasks-per-node=1",
                           "--output=/dev/null", f"--wrap={wrap}"], capture_output=True,
                          text=True, check=True)
    job = done.stdout.strip().split(";")[0]
    while subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True,
                         check=False).stdout.strip():
        time.sleep(0.5)
    if not out.is_file():
        raise RuntimeError(f"the bare srun leg (job {job}) wrote no result")


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m hpc_ddp.bench entries",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6,
                        help="interleaved rounds (at least 6 for a figure worth quoting)")
    parser.add_argument("--steps", type=int, default=100, help="steps per leg")
    parser.add_argument("--slurm-nodes", type=int, default=0,
                        help="also compare script= with a bare srun on this many nodes")
    parser.add_argument("--json", default=None, help="write the figures here")
    args, overrides = parser.parse_known_args(argv)
    for name in ("rounds", "steps"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name}", getattr(args, name), "must be 1 or more.",
                            f"e.g. --{name} 4.")
    if args.slurm_nodes < 0:
        raise UserError("--slurm-nodes", args.slurm_nodes, "must be 0 or more.",
                        "give the nodes of the comparison, e.g. --slurm-nodes 4.")
    return args, overrides


def main(argv: Sequence[str]) -> int:
    try:
        args, overrides = parse(argv)
    except UserError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return USAGE_EXIT_CODE
    results: dict[str, Any] = {}
    print("function entry vs the same loop bare (2 local ranks, tiny CNN) ...",
          file=sys.stderr, flush=True)
    entry = results["function_entry"] = function_entry(args.rounds, args.steps, overrides)
    print(f"function entry: {1000 * entry['calls_ms_per_step']:.1f} us/step in the context's "
          f"calls = {entry['overhead_pct']:.2f} % of a {entry['bare_step_ms']:.3f} ms bare "
          f"step (target <= 1 %: {'met' if entry['overhead_pct'] <= 1 else 'NOT met'}); "
          f"interleaved step times {entry['entry_step_ms']:.3f} vs {entry['bare_step_ms']:.3f}"
          f" ms ({entry['ab_difference_pct']:+.2f} %; bare rounds spread "
          f"{entry['bare_spread_pct']:.1f} %)")
    if args.slurm_nodes:
        print(f"script= vs bare srun on {args.slurm_nodes} nodes ...", file=sys.stderr,
              flush=True)
        script = results["script"] = script_vs_srun(args.slurm_nodes, args.rounds,
                                                    args.steps, overrides)
        print(f"script: {script['script_samples_per_s']:.0f} samples/s under script= vs "
              f"{script['srun_samples_per_s']:.0f} under bare srun (medians of "
              f"{script['rounds']} interleaved rounds; spread "
              f"{100 * script['script_spread']:.1f} % and {100 * script['srun_spread']:.1f} %): "
              f"ratio {script['ratio']:.3f}, median of the rounds' "
              f"{script['ratio_min']:.3f}..{script['ratio_max']:.3f} (target >= 0.99: "
              f"{'met' if script['ratio'] >= 0.99 else 'NOT met'})")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0
