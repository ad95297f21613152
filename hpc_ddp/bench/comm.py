"""Collective bandwidth by message size: ``python -m hpc_ddp.bench comm [options] [overrides]``.

    python -m hpc_ddp.bench comm                               # local, 2 ranks, 1 KiB..256 MiB
    python -m hpc_ddp.bench comm cluster=slurm nodes=2 --max-size 64MiB
    python -m hpc_ddp.bench comm cluster=slurm nodes=4 nccl=infiniband --ops all_reduce

all_reduce, all_gather and reduce_scatter with nccl-tests' definitions
(https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md): the size is the whole
buffer (all_gather: the gathered output, reduce_scatter: the input), algbw = size / time, and
busbw = algbw * 2(n-1)/n for all_reduce, algbw * (n-1)/n for the other two. The time is the
slowest rank's mean over the timed iterations, after warm-up. On several nodes it also streams
bytes over one plain TCP connection between rank 0 and another node (the physical limit for a
socket backend such as Gloo) and prints the all-reduce busbw as a fraction of it.
Each row is printed as soon as its size is measured. Writes bench/comm.json and
bench/comm.png into the run dir.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time
from collections.abc import MutableMapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

from hpc_ddp.config.compose import to_yaml
from hpc_ddp.config.schema import Config
from hpc_ddp.doctor import job
from hpc_ddp.doctor.job import add_job_arguments, check_timeout
from hpc_ddp.errors import USAGE_EXIT_CODE, UserError
from hpc_ddp.rank.join.joined import joined
from hpc_ddp.rank.main.task import RankProgram
from hpc_ddp.rundir import RunDir, read_json, write_json

log = logging.getLogger(__name__)
OPS = ("all_reduce", "all_gather", "reduce_scatter")
RESULT = Path("bench") / "comm.json"
# One JSON line per measured row, appended by rank 0 as it goes (read to print progress).
ROWS = Path("bench") / "comm.rows.jsonl"
PLOT = Path("bench") / "comm.png"
_UNITS = {"": 1, "B": 1, "K": 2**10, "KIB": 2**10, "KB": 2**10, "M": 2**20, "MIB": 2**20,
          "MB": 2**20, "G": 2**30, "GIB": 2**30, "GB": 2**30}


@dataclass(frozen=True)
class CommOptions:
    min_bytes: int = 2**10
    max_bytes: int = 256 * 2**20
    factor: int = 2
    iters: int = 20
    warmup: int = 5
    # Seconds of timed iterations per size at most (large sizes then run fewer iterations).
    budget_s: float = 1.0
    ops: tuple[str, ...] = OPS
    # Seconds of the raw TCP stream (0: skip it).
    tcp_seconds: float = 3.0


def parse_size(text: str) -> int:
    """Bytes from "1024", "1K", "4MiB", "256M" (binary units, as nccl-tests)."""
    match = re.fullmatch(r"\s*([0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else "?"
    if not match or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; use e.g. 1K, 4MiB, 256M")
    return int(match.group(1)) * _UNITS[unit]


def sizes(options: CommOptions) -> list[int]:
    out, size = [], options.min_bytes
    while size <= options.max_bytes:
        out.append(size)
        size *= options.factor
    return out


def bus_factor(op: str, world: int) -> float:
    """busbw / algbw for ``op`` on ``world`` ranks (nccl-tests PERFORMANCE.md)."""
    if world < 2:
        return 0.0
    return 2 * (world - 1) / world if op == "all_reduce" else (world - 1) / world


def human(nbytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes:g} B"


def run(cfg: Config, run_dir: RunDir, environ: MutableMapping[str, str],
        options: CommOptions) -> dict[str, Any] | None:
    """One rank of the benchmark; rank 0 returns (and writes) the results."""
    import torch.distributed as dist  # deferred: torch; start-up: bench.tcp

    from hpc_ddp.bench import tcp

    with joined(cfg, run_dir, environ) as rank:
        world = rank.env.world_size
        rows = []
        for op in options.ops:
            for size in sizes(options):
                rows.append(measure(op, size, rank.device, options))
                if rank.env.is_master and rows[-1] is not None:
                    _append_row(run_dir.root / ROWS, rows[-1])
        hosts: list[Any] = [None] * world
        dist.all_gather_object(hosts, rank.host)
        raw = tcp.measure(rank.env.rank, hosts, options.tcp_seconds)
        if not rank.env.is_master:
            return None
        result = {"world_size": world, "hosts": hosts, "backend": str(dist.get_backend()),
                  "device": str(rank.device), "options": asdict(options),
                  "rows": [r for r in rows if r is not None], "tcp": raw}
        result["ratio"] = ratio(result)
        write_json(run_dir.root / RESULT, result)
        return result


def measure(op: str, size: int, device: Any, options: CommOptions) -> dict[str, Any] | None:
    """Time ``op`` on a ``size``-byte buffer; None when the size is too small to split."""
    # deferred: torch
    import torch
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    per_rank = size // 4 // world
    if op != "all_reduce" and per_rank == 0:
        return None
    count = size // 4 if op == "all_reduce" else per_rank * world
    big = torch.zeros(count, dtype=torch.float32, device=device)
    small = torch.zeros(count // world, dtype=torch.float32, device=device)

    def once() -> None:
        if op == "all_reduce":
            dist.all_reduce(big)
        elif op == "all_gather":
            dist.all_gather_single(big, small)
        else:
            dist.reduce_scatter_single(small, big)

    for _ in range(max(options.warmup, 1)):
        once()
    # How many timed iterations fit the budget, agreed by all ranks (the slowest decides).
    probe = _timed(once, 1, device)
    iters = max(1, min(options.iters, int(options.budget_s / max(probe, 1e-9))))
    iters = int(_max_over_ranks(float(iters), device, minimum=True))
    per_op = _max_over_ranks(_timed(once, iters, device), device) / iters
    algbw = count * 4 / per_op / 1e9
    return {"op": op, "bytes": count * 4, "count": count, "iters": iters,
            "time_us": per_op * 1e6, "algbw_gbps": algbw,
            "busbw_gbps": algbw * bus_factor(op, world),
            "correct": _check(op, count, world, rank, device)}


def _timed(fn: Any, iters: int, device: Any) -> float:
    import torch.distributed as dist  # deferred: torch

    _sync(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    return time.perf_counter() - start


def _max_over_ranks(value: float, device: Any, minimum: bool = False) -> float:
    # deferred: torch
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN if minimum else dist.ReduceOp.MAX)
    return float(t.item())


def _check(op: str, count: int, world: int, rank: int, device: Any) -> bool:
    """One more call on known data: every rank contributes rank+1."""
    # deferred: torch
    import torch
    import torch.distributed as dist

    mine = float(rank + 1)
    if op == "all_reduce":
        data = torch.full((count,), mine, device=device)
        dist.all_reduce(data)
        return bool(torch.all(data == world * (world + 1) / 2).item())
    part = count // world
    if op == "all_gather":
        out = torch.empty(count, device=device)
        dist.all_gather_single(out, torch.full((part,), mine, device=device))
        expected = torch.arange(1, world + 1, device=device,
                                dtype=out.dtype).repeat_interleave(part)
        return bool(torch.equal(out, expected))
    out = torch.empty(part, device=device)
    dist.reduce_scatter_single(out, torch.full((count,), mine, device=device))
    return bool(torch.all(out == world * (world + 1) / 2).item())


def _append_row(path: Path, row: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")


def _sync(device: Any) -> None:
    if device.type == "cuda":
        import torch  # deferred: torch

        torch.cuda.synchronize(device)


def ratio(result: dict[str, Any]) -> dict[str, Any] | None:
    """Busbw of each op at its largest size (and at its best size) as a fraction of the raw
    TCP bandwidth."""
    raw = result.get("tcp")
    if not raw or not raw["gbps"]:
        return None
    out: dict[str, Any] = {"tcp_gbps": raw["gbps"]}
    for op in OPS:
        rows = [r for r in result["rows"] if r["op"] == op]
        if rows:
            last = max(rows, key=lambda r: r["bytes"])
            peak = max(rows, key=lambda r: r["busbw_gbps"])
            out[op] = {"bytes": last["bytes"], "busbw_gbps": last["busbw_gbps"],
                       "ratio": last["busbw_gbps"] / raw["gbps"], "peak_bytes": peak["bytes"],
                       "peak_busbw_gbps": peak["busbw_gbps"],
                       "peak_ratio": peak["busbw_gbps"] / raw["gbps"]}
    return out


HEAD = ("op", "size", "count", "iters", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "check")
# Fixed widths, so rows can be printed one by one as they are measured.
WIDTHS = (14, 11, 10, 5, 10, 11, 11, 5)


def _line(cells: Sequence[str]) -> str:
    return "  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                     for i, (c, w) in enumerate(zip(cells, WIDTHS, strict=True))).rstrip()


def row_line(r: dict[str, Any]) -> str:
    return _line((r["op"], human(r["bytes"]), str(r["count"]), str(r["iters"]),
                  f"{r['time_us']:.1f}", f"{r['algbw_gbps']:.3f}", f"{r['busbw_gbps']:.3f}",
                  "ok" if r["correct"] else "WRONG"))


def summary_lines(result: dict[str, Any]) -> list[str]:
    """What follows the rows: the job's shape, raw TCP and the ratios to it."""
    raw, share = result.get("tcp"), result.get("ratio")
    lines = ["", f"{result['backend']} on {result['world_size']} ranks, "
                 f"{len(set(result['hosts']))} host(s), device {result['device']}"]
    if raw:
        where = ("same host (loopback)" if raw["same_host"]
                 else f"{raw['from_host']} -> {raw['to_host']}")
        lines.append(f"raw TCP {where}, one stream for {raw['seconds']:.1f}s: "
                     f"{raw['gbps']:.3f} GB/s")
    for op in OPS:
        if share and op in share:
            s = share[op]
            lines.append(f"{result['backend']} {op} busbw at {human(s['bytes'])}: "
                         f"{s['busbw_gbps']:.3f} GB/s = {s['ratio']:.2f} x raw TCP (peak "
                         f"{s['peak_busbw_gbps']:.3f} GB/s at {human(s['peak_bytes'])} = "
                         f"{s['peak_ratio']:.2f} x)")
    return lines


def table(result: dict[str, Any]) -> str:
    return "\n".join([_line(HEAD), *(row_line(r) for r in result["rows"]),
                      *summary_lines(result)])


class RowPrinter:
    """Prints the rows rank 0 appends to ``ROWS``, each once, under one header."""

    def __init__(self, path: Path, out: TextIO) -> None:
        self.path, self.out, self.printed = path, out, 0

    def __call__(self) -> None:
        try:
            text = self.path.read_text()
        except OSError:
            return  # not written yet
        done = text.split("\n")[:-1]  # a line without its newline is still being written
        for line in done[self.printed:]:
            if self.printed == 0:
                print(_line(HEAD), file=self.out)
            print(row_line(json.loads(line)), file=self.out, flush=True)
            self.printed += 1


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hpc_ddp.bench comm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--min-size", type=parse_size, default=CommOptions.min_bytes)
    p.add_argument("--max-size", type=parse_size, default=CommOptions.max_bytes,
                   help="largest message (default 256MiB; e.g. 4MiB for a quick run)")
    p.add_argument("--factor", type=int, default=CommOptions.factor)
    p.add_argument("--iters", type=int, default=CommOptions.iters)
    p.add_argument("--warmup", type=int, default=CommOptions.warmup)
    p.add_argument("--budget-s", type=float, default=CommOptions.budget_s,
                   help="seconds of timed iterations per size at most (default 1)")
    p.add_argument("--ops", default=",".join(OPS), help="comma list of " + ", ".join(OPS))
    p.add_argument("--tcp-seconds", type=float, default=CommOptions.tcp_seconds,
                   help="raw TCP stream length (0: skip)")
    add_job_arguments(p, plot=str(PLOT))
    return p


def options_from(args: argparse.Namespace) -> CommOptions:
    ops = tuple(o.strip() for o in args.ops.split(",") if o.strip())
    bad = [o for o in ops if o not in OPS]
    if bad or not ops:
        raise UserError("--ops", args.ops, "names an unknown collective.",
                        f"use a comma list of {', '.join(OPS)}.")
    if not 0 < args.min_size <= args.max_size or args.factor < 2 or args.iters < 1:
        raise UserError("--min-size/--max-size/--factor/--iters",
                        f"{args.min_size}/{args.max_size}/{args.factor}/{args.iters}",
                        "need 0 < min <= max, factor >= 2, iters >= 1.",
                        "e.g. --min-size 1K --max-size 4MiB.")
    if not args.budget_s > 0:
        raise UserError("--budget-s", args.budget_s, "must be a positive number of seconds.",
                        "e.g. --budget-s 1.")
    check_timeout(args.timeout_s)
    return CommOptions(args.min_size, args.max_size, args.factor, args.iters,
                       max(args.warmup, 1), args.budget_s, ops, args.tcp_seconds)


def main(argv: Sequence[str] | None = None, out: TextIO = sys.stdout) -> int:
    args = parser().parse_intermixed_args(sys.argv[1:] if argv is None else argv)
    try:
        options = options_from(args)
        cfg, bench_dir = job.prepare(args.overrides, "bench-comm", os.environ, Path.cwd())
        program = RankProgram(run, to_yaml(cfg), str(bench_dir.root), options)
        printer = RowPrinter(bench_dir.root / ROWS, out)
        job.submit_and_wait(cfg, bench_dir, program, out, args.timeout_s, on_poll=printer)
    except UserError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return USAGE_EXIT_CODE
    result = read_json(bench_dir.root / RESULT)
    if result is None:
        return job.did_not_finish(bench_dir, out)
    if printer.printed == len(result["rows"]):
        print("\n".join(summary_lines(result)), file=out)
    else:
        print(table(result), file=out)
    if not args.no_plot:
        from hpc_ddp.bench.plot import plot  # deferred (start-up): bench.plot

        print(plot(result, bench_dir.root / PLOT), file=out)
    print(f"results: {bench_dir.root / RESULT}", file=out, flush=True)
    return 0 if all(r["correct"] for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
