"""What the scaling report measures, shared by its driver (scaling.py) and the program every
rank runs (scaling_rank.py): the options, the node counts, the fixes, the files it writes.

Pure: nothing here touches torch, the run dir's ranks or the cluster (the progress file's
two helpers read and append one JSON line each).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_ddp.config.schema import TrainerConfig
from hpc_ddp.config.sync_rules import MIN_POWERSGD_WARMUP
from hpc_ddp.errors import UserError

RESULT = Path("bench") / "scaling.json"
PLOT = Path("bench") / "scaling.png"
# One JSON line per stage, appended by rank 0 as it goes (the driver prints them).
PROGRESS = Path("bench") / "scaling.progress.jsonl"
# DDP's bucket size when trainer.ddp_bucket_cap_mb is null (torch's bucket_cap_mb default,
# https://pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html).
DDP_DEFAULT_BUCKET_MB = 25
FIX_CHOICES = ("auto", "all", "none")


@dataclass(frozen=True)
class ScalingOptions:
    # Node counts measured, ascending (the job's own nodes= is the largest one given).
    sizes: tuple[int, ...]
    # Timed optimizer steps per node count, in `windows` windows (a median is possible).
    steps: int = 30
    windows: int = 3
    # Untimed steps of every trainer first (DDP rebuilds its buckets after the first one).
    warmup_steps: int = 5
    # Steps of the all-reduce probe (each bucket's all-reduce timed), after 2 untimed ones.
    probe_steps: int = 5
    # Seconds of timed bare all-reduces per node count (comm.measure's budget).
    busbw_budget_s: float = 0.5
    # auto: run the fixes when the verdict is the fabric; all: always; none: never.
    fixes: str = "auto"
    # Seconds the ranks outside a smaller world wait for it to end (generous: a failure ends
    # the job sooner, through the job's own failure handling).
    wait_s: float = 3600.0


@dataclass(frozen=True)
class Fix:
    """One remedy for slow gradient sync, run at the largest node count."""

    name: str
    overrides: tuple[str, ...]  # what the measured run adds to the config
    advice: tuple[str, ...]  # what the override line adds (may differ: PowerSGD's warm-up)


def default_sizes(nodes: int) -> tuple[int, ...]:
    """1, 2, 4, ... doubling below ``nodes``, then ``nodes`` itself."""
    out, k = [], 1
    while k < nodes:
        out.append(k)
        k *= 2
    return (*out, nodes)


def parse_sizes(text: str, nodes: int) -> tuple[int, ...]:
    """--nodes-list: node counts between 1 and ``nodes``, at least two; sorted, unique."""
    fix = f"give a comma list of node counts from 1 to nodes={nodes}, e.g. 1,{nodes}."
    try:
        sizes = tuple(sorted({int(s) for s in text.split(",") if s.strip()}))
    except ValueError:
        raise UserError("--nodes-list", text, "is not a comma list of integers.", fix) from None
    if not sizes or sizes[0] < 1 or sizes[-1] > nodes:
        raise UserError("--nodes-list", text, f"must lie between 1 and the job's nodes={nodes}.",
                        fix)
    if len(sizes) < 2:
        raise UserError("--nodes-list", text, "has one node count: nothing to compare.", fix)
    return sizes


def window_steps(steps: int, windows: int) -> list[int]:
    """``steps`` split into ``windows`` windows as even as whole steps allow (the first ones
    one longer); fewer windows when there are fewer steps."""
    n = max(1, min(windows, steps))
    base, extra = divmod(steps, n)
    return [base + (1 if i < extra else 0) for i in range(n)]


def fixes_for(t: TrainerConfig, warmup_steps: int) -> tuple[Fix, ...]:
    """The fixes to try against the config's own sync settings, each changing one thing
    (what the config already uses is not a fix: left out). ``warmup_steps``: the report's
    untimed steps before each run's timed ones."""
    out = []
    for hook in ("bf16", "fp16", "powersgd"):
        if t.ddp_comm_hook == hook:
            continue
        line = (f"trainer.ddp_comm_hook={hook}",)
        # PowerSGD's own warm-up (plain all-reduces, 1000 steps by default) would cover the
        # timed steps: measured compressing from the first timed step (the report's warm-up,
        # at least what torch allows); the line keeps the config's warm-up.
        start = max(MIN_POWERSGD_WARMUP, warmup_steps)
        extra = (f"trainer.ddp_powersgd_warmup_steps={start}",) if hook == "powersgd" else ()
        out.append(Fix(hook, (*line, *extra), line))
    bucket = 4 * (t.ddp_bucket_cap_mb or DDP_DEFAULT_BUCKET_MB)
    line = (f"trainer.ddp_bucket_cap_mb={bucket}",)
    out.append(Fix(f"bucket {bucket} MB", line, line))
    line = (f"trainer.grad_accum={2 * t.grad_accum}",)
    out.append(Fix(f"grad_accum {2 * t.grad_accum}", line, line))
    return tuple(out)


def say(root: Path, line: str) -> None:
    """Append one progress line (rank 0, as each stage starts or ends)."""
    path = root / PROGRESS
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps({"line": line, "time": time.time()}) + "\n")


def said(root: Path) -> list[str]:
    """Every progress line so far (a line being written is left for the next read)."""
    try:
        text = (root / PROGRESS).read_text()
    except OSError:
        return []
    out = []
    for raw in text.splitlines(keepends=True):
        if not raw.endswith("\n"):
            break
        try:
            record: Any = json.loads(raw)
        except ValueError:
            break
        out.append(str(record.get("line", "")))
    return out
