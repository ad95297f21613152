"""The scaling report's figures from its raw windows: one row per node count, the verdict
that names the bottleneck, the fixes side by side, the override line; and the tables.

Pure: dicts in, dicts and text out (the ranks call :func:`rows_of` and :func:`verdict` to
decide whether to run the fixes; the driver everything).

A run's figures (one node count, or one fix at the largest): samples/s is the median over
its windows of the global batch per step times the window's steps over the window's time, a
window's time its slowest rank's (DDP moves at the pace of the slowest rank); the step split
(loop_timing's phases) is the mean over ranks, the median over windows, in ms per step;
``sync`` is the exposed gradient sync (``comm``), its share of a step
loop_timing.sync_share. Speed-up and efficiency are against the smallest node count
measured: E(k) = samples/s(k) / ((k / k0) * samples/s(k0)), with k0 = 1 the usual
E(k) = samples/s(k) / (k * samples/s(1)).
"""

from __future__ import annotations

import math
import shlex
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from hpc_ddp.trainer.loop_timing import PHASES, sync_share

# The verdict's thresholds (docs/performance.md#the-scaling-report), at the largest node
# count, checked in the order of :func:`verdict`:
# the loader: this share of a step or more spent waiting for the next batch.
LOADER_SHARE = 0.20
# efficiency at or above this: scales well (the pitfall the docs name is "under 80 %").
SCALES_WELL = 0.80
# a straggler: the slowest node's median compute per step this many times the other nodes'
# median. Checked before the shares: the others wait for it inside the all-reduce, so a
# straggler also looks like slow sync from everywhere else.
STRAGGLER_FACTOR = 1.25
# ... and its extra compute this share of a step at least: a slow node that costs the step
# little is not what limits it (a short compute differs between nodes by noise: 5 against
# 6.5 ms in a 126 ms step waiting on a shaped link, seen on the test cluster).
STRAGGLER_SHARE = 0.10
# the fabric: this share of a step or more spent waiting on the gradient all-reduce.
SYNC_SHARE = 0.20
# A fix's loss after the same steps may exceed the plain run's by this fraction of it, at
# most, to be chosen (compression changes the gradients; a few dozen steps of one seed tell
# a fix that breaks training from one that costs nothing measurable, not finer).
LOSS_TOLERANCE = 0.05

SCALES, STRAGGLER, LOADER, FABRIC, PHASE = "scales well", "straggler", "loader", "fabric", \
    "phase"
# The fix that changes the global batch (scaling_plan.fixes_for names it "grad_accum N").
ACCUMULATION = "grad_accum"
NAMES = {"data": "data wait", "compute": "compute", "comm": "gradient sync",
         "optimizer": "optimizer", "other": "other"}


@dataclass(frozen=True)
class Verdict:
    cause: str  # one of SCALES, STRAGGLER, LOADER, FABRIC, PHASE
    line: str
    node: str | None = None  # the straggler
    factor: float | None = None  # its compute against the other nodes'
    phase: str | None = None  # PHASE: the one that grew most

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_row(run: dict[str, Any]) -> dict[str, Any]:
    """The figures of one run (its raw windows: every rank's Window dict per window)."""
    windows = run["windows"]
    steps = sum(w[0]["steps"] for w in windows)
    rates = [run["samples_per_step"] * w[0]["steps"] / wall for w in windows
             if (wall := max(r["wall_s"] for r in w)) > 0]
    split = {p: statistics.median(statistics.fmean(_ms(r, p) for r in w) for w in windows)
             for p in (*PHASES, "step")}
    nodes: dict[str, list[float]] = {}
    for w in windows:
        per: dict[str, list[float]] = {}
        for label, r in zip(run["node_of_rank"], w, strict=True):
            per.setdefault(label, []).append(_ms(r, "compute"))
        for label, values in per.items():
            nodes.setdefault(label, []).append(statistics.fmean(values))
    fabric = run.get("fabric") or {}
    return {"nodes": run["nodes"], "ranks": run["ranks"], "steps": steps,
            "samples_per_s": statistics.median(rates) if rates else 0.0,
            "step_ms": split, "data_share": _share(split["data"], split["step"]),
            "sync_share": sync_share(split["comm"], split["step"]),
            "node_compute_ms": {k: statistics.median(v) for k, v in nodes.items()},
            "loss": run.get("loss"),
            "busbw_gbps": fabric.get("achieved_busbw_gbps"),
            "bare_busbw_gbps": fabric.get("bare_busbw_gbps"),
            "bucket_bytes": fabric.get("bucket_bytes")}


def _ms(rank: dict[str, Any], phase: str) -> float:
    key = "wall_s" if phase == "step" else f"{phase}_s"
    return float(rank[key]) * 1e3 / max(int(rank["steps"]), 1)


def _share(part: float, step: float) -> float | None:
    return min(1.0, max(0.0, part / step)) if step > 0 else None


def rows_of(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per node count, with speed-up and efficiency against the smallest."""
    rows = sorted((run_row(r) for r in runs), key=lambda r: r["nodes"])
    if not rows:
        return rows
    base = rows[0]
    for row in rows:
        row["speedup"] = (row["samples_per_s"] / base["samples_per_s"]
                          if base["samples_per_s"] > 0 else None)
        row["efficiency"] = efficiency(row["samples_per_s"], row["nodes"],
                                       base["samples_per_s"], base["nodes"])
    return rows


def efficiency(rate: float, nodes: int, base_rate: float, base_nodes: int) -> float | None:
    """samples/s on ``nodes`` against ``nodes / base_nodes`` times the base's (1.0: linear)."""
    if base_rate <= 0 or nodes <= 0:
        return None
    return rate / (nodes / base_nodes * base_rate)


def verdict(rows: Sequence[dict[str, Any]]) -> Verdict:
    """What limits the run at the largest node count (the thresholds above). The loader
    first: a step that mostly waits for its next batch is the loader's however well it scales
    (each node's loader sets the pace; more nodes only multiply it). Then, below SCALES_WELL,
    a straggler, the fabric, or the phase that grew most."""
    top, base = rows[-1], rows[0]
    eff = top.get("efficiency")
    at = (f"efficiency {_pct(eff)} at {top['nodes']} nodes against {base['nodes']}")
    data, sync = top.get("data_share") or 0.0, top.get("sync_share") or 0.0
    if data >= LOADER_SHARE:
        return Verdict(LOADER, f"the loader: {_pct(data)} of each step waits for the next "
                       f"batch (>= {_pct(LOADER_SHARE)}); {at}")
    if eff is not None and eff >= SCALES_WELL:
        return Verdict(SCALES, f"scales well: {at} (>= {_pct(SCALES_WELL)})")
    slow = straggler(top["node_compute_ms"])
    if slow is not None and slow[1] >= STRAGGLER_FACTOR and lost_to(
            slow[0], top["node_compute_ms"]) >= STRAGGLER_SHARE * top["step_ms"]["step"]:
        node, factor = slow
        return Verdict(STRAGGLER, f"a straggler: node {node} computes {factor:.2f}x as long "
                       "per step as the other nodes' median (the others wait for it in the "
                       f"gradient sync); {at}", node=node, factor=factor)
    if sync >= SYNC_SHARE:
        bw = ""
        if top.get("busbw_gbps") is not None and top.get("bare_busbw_gbps") is not None:
            bw = (f"; the all-reduce ran at {top['busbw_gbps']:.2f} GB/s busbw, the fabric "
                  f"gives {top['bare_busbw_gbps']:.2f} GB/s at DDP's bucket size")
        return Verdict(FABRIC, f"the fabric (gradient sync): {_pct(sync)} of each step waits "
                       f"on the gradient all-reduce (>= {_pct(SYNC_SHARE)}); {at}{bw}")
    grown = {p: top["step_ms"][p] - base["step_ms"][p] for p in PHASES}
    phase = max(grown, key=lambda p: grown[p])
    return Verdict(PHASE, f"no cause above its threshold; {NAMES[phase]} grew most from "
                   f"{base['nodes']} node(s): {grown[phase]:+.2f} ms per step; {at}",
                   phase=phase)


def lost_to(node: str, node_compute_ms: dict[str, float]) -> float:
    """The ms per step ``node`` computes beyond the other nodes' median: what every other
    rank waits for it."""
    others = [v for n, v in node_compute_ms.items() if n != node]
    return node_compute_ms[node] - statistics.median(others) if others else 0.0


def straggler(node_compute_ms: dict[str, float]) -> tuple[str, float] | None:
    """(the slowest node, its compute per step over the other nodes' median); None with
    fewer than two nodes."""
    if len(node_compute_ms) < 2:
        return None
    node = max(node_compute_ms, key=lambda n: node_compute_ms[n])
    others = statistics.median(v for n, v in node_compute_ms.items() if n != node)
    return node, (node_compute_ms[node] / others if others > 0 else math.inf)


def busy_s(intervals: Sequence[tuple[float, float]]) -> float:
    """The time at least one of ``intervals`` (start, end) was open: their union's length."""
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def achieved(ranks: Sequence[Sequence[Sequence[Any]]], factor: float) -> dict[str, Any]:
    """The bandwidth a probe's steps got from the fabric. ``ranks``: every rank's marks
    (bucket_timing.BucketTimes.stop's (step, bucket, start s, end s, bytes), each rank's
    counted from the same barrier). A bucket's all-reduce runs from the last rank's start to
    the last rank's completion; per step, its buckets' bytes times ``factor``
    (comm.bus_factor: busbw, as nccl-tests) over the time any bucket was in flight
    (:func:`busy_s`); the median over steps."""
    buckets: dict[tuple[int, int], list[float]] = {}
    for marks in ranks:
        for step, index, a, b, nbytes in marks:
            got = buckets.setdefault((int(step), int(index)), [a, b, nbytes])
            got[0], got[1] = max(got[0], a), max(got[1], b)
    steps: dict[int, list[list[float]]] = {}
    for (step, _), got in buckets.items():
        steps.setdefault(step, []).append(got)
    busy = [(sum(n for _, _, n in v), busy_s([(a, b) for a, b, _ in v]))
            for v in steps.values()]
    rates = [n * factor / t / 1e9 for n, t in busy if t > 0]
    return {"achieved_busbw_gbps": statistics.median(rates) if rates else None,
            "busy_ms": statistics.median(t for _, t in busy) * 1e3 if busy else None,
            "bytes_per_step": statistics.median(n for n, _ in busy) if busy else None,
            "probe_steps": len(busy)}


def within_tolerance(loss: float | None, plain: float | None) -> bool:
    """A fix's loss no more than LOSS_TOLERANCE (of the plain run's) above the plain run's."""
    if loss is None or plain is None or not (math.isfinite(loss) and math.isfinite(plain)):
        return False
    return loss <= plain + LOSS_TOLERANCE * abs(plain)


def fix_rows(plain: dict[str, Any], fixes: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each fix's row beside the plain run's (the largest node count); a skipped fix keeps
    its reason."""
    rows = []
    for fix in fixes:
        head = {"fix": fix["name"], "advice": list(fix["advice"]), "skipped": fix.get("skipped")}
        if fix.get("skipped"):
            rows.append(head)
            continue
        row = {**head, **run_row(fix)}
        row["vs_plain"] = (row["samples_per_s"] / plain["samples_per_s"]
                           if plain["samples_per_s"] > 0 else None)
        row["within_tolerance"] = within_tolerance(row["loss"], plain["loss"])
        rows.append(row)
    return rows


def pick(plain: dict[str, Any], rows: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The fastest fix whose loss is within tolerance, if it beats the plain run; one that
    keeps the global batch first (a hook, the buckets): accumulation trains with twice the
    samples per step, which changes the run beyond its speed (the learning rate's schedule
    per sample), so it is chosen only when nothing else wins."""
    fit = [r for r in rows if not r.get("skipped") and r["within_tolerance"]
           and r["samples_per_s"] > plain["samples_per_s"]]
    same = [r for r in fit if not str(r["fix"]).startswith(ACCUMULATION)]
    return max(same or fit, key=lambda r: r["samples_per_s"]) if fit else None


def override_line(user: Sequence[str], advice: Sequence[str]) -> str:
    """The submit command: the user's overrides (one the advice sets again left out), then
    the advice."""
    keys = {a.partition("=")[0] for a in advice}
    kept = [o for o in user if o.partition("=")[0].lstrip("+~") not in keys]
    return " ".join(["python -m hpc_ddp.submit", *(shlex.quote(o) for o in (*kept, *advice))])


def combine(raw: dict[str, Any], user: Sequence[str]) -> dict[str, Any]:
    """The whole result: the raw runs plus rows, verdict, fixes, the chosen one and its line."""
    rows = rows_of(raw["sizes"])
    found = verdict(rows)
    fixes = fix_rows(rows[-1], raw.get("fixes", []))
    chosen = pick(rows[-1], fixes)
    return {**{k: v for k, v in raw.items() if k not in ("sizes", "fixes")},
            "rows": rows, "verdict": found.as_dict(), "fix_rows": fixes,
            "chosen": chosen["fix"] if chosen else None,
            # The chosen fix's line; the user's own when no fix won; none when none ran.
            "override_line": override_line(user, chosen["advice"] if chosen else ())
            if fixes else None,
            "user_overrides": list(user), "loss_tolerance": LOSS_TOLERANCE,
            "raw": {"sizes": raw["sizes"], "fixes": raw.get("fixes", [])}}


# -- text ---------------------------------------------------------------------------------------
def _pct(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.0f}%"


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _split(ms: dict[str, float]) -> tuple[str, ...]:
    return tuple(f"{ms[p]:.2f}" for p in ("step", *PHASES))


def _lay(lines: list[tuple[str, ...]], left: int) -> list[str]:
    widths = [max(len(row[i]) for row in lines) for i in range(len(lines[0]))]
    return ["  ".join(c.ljust(w) if i < left else c.rjust(w)
                      for i, (c, w) in enumerate(zip(row, widths, strict=True))).rstrip()
            for row in lines]


SPLIT_HEAD = ("step ms", "data", "compute", "sync", "optim", "other")


def table(result: dict[str, Any]) -> str:
    """The node counts side by side, the verdict line, then the fixes (if any ran)."""
    lines: list[tuple[str, ...]] = [("nodes", "ranks", "samples/s", "speed-up", "efficiency",
                                     *SPLIT_HEAD, "sync %", "busbw GB/s", "bare GB/s")]
    for r in result["rows"]:
        lines.append((str(r["nodes"]), str(r["ranks"]), f"{r['samples_per_s']:.1f}",
                      _num(r["speedup"], ".2f") + "x", _pct(r["efficiency"]),
                      *_split(r["step_ms"]), _pct(r["sync_share"]),
                      _num(r["busbw_gbps"], ".3f"), _num(r["bare_busbw_gbps"], ".3f")))
    out = _lay(lines, 0)
    bucket = next((r["bucket_bytes"] for r in result["rows"] if r.get("bucket_bytes")), None)
    out += ["", f"{result['device']} ({result['backend']}), batch {result['batch_size']} per "
            f"rank, {result['tasks_per_node']} rank(s) per node, {result['steps']} timed steps "
            f"per run after {result['warmup_steps']} warm-up; torch {result['torch']}"
            + (f"; bare: all-reduce of {bucket / 2**20:g} MiB (DDP's bucket)" if bucket else ""),
            f"verdict: {result['verdict']['line']}"]
    if result["fix_rows"]:
        out += ["", *fixes_table(result)]
    return "\n".join(out)


def fixes_table(result: dict[str, Any]) -> list[str]:
    plain = result["rows"][-1]
    lines: list[tuple[str, ...]] = [("fix", "samples/s", "x plain", *SPLIT_HEAD, "loss",
                                     "vs plain", "")]
    lines.append(("(plain)", f"{plain['samples_per_s']:.1f}", "1.00x", *_split(plain["step_ms"]),
                  _num(plain["loss"], ".4f"), "", ""))
    skipped = []
    for r in result["fix_rows"]:
        if r.get("skipped"):
            skipped.append(f"  {r['fix']}: skipped: {r['skipped']}")
            continue
        delta = (f"{100 * (r['loss'] - plain['loss']) / abs(plain['loss']):+.1f}%"
                 if r["loss"] is not None and plain["loss"] else "-")
        mark = "chosen" if r["fix"] == result["chosen"] else (
            "" if r["within_tolerance"] else "loss over tolerance")
        lines.append((r["fix"], f"{r['samples_per_s']:.1f}", _num(r["vs_plain"], ".2f") + "x",
                      *_split(r["step_ms"]), _num(r["loss"], ".4f"), delta, mark))
    out = [f"fixes at {plain['nodes']} nodes, {plain['steps']} steps each (loss: the mean "
           f"training loss of the last window, all ranks; tolerance +"
           f"{_pct(result['loss_tolerance'])} of the plain run's):", *_lay(lines, 1), *skipped]
    if result["chosen"]:
        out += ["", f"use: {result['override_line']}"]
    else:
        out += ["", "no fix was faster than the plain run within the loss tolerance; keep "
                f"your settings: {result['override_line']}"]
    return out
