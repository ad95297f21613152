"""``bench comm`` at a toy size: rank 0 appends each row as it is measured, and the command
prints every row once, under one header, then the summary (not the whole table again)."""

from __future__ import annotations

import io
import json
from pathlib import Path

from hpc_ddp.bench.comm import ROWS, main


def test_bench_comm_streams_its_rows(tmp_path: Path) -> None:
    run_dir = tmp_path / "bench"
    out = io.StringIO()
    code = main(["--ops", "all_reduce", "--min-size", "1K", "--max-size", "4K", "--iters", "2",
                 "--tcp-seconds", "0", "--no-plot", "cluster=local", f"run_dir={run_dir}"],
                out=out)
    text = out.getvalue()
    assert code == 0, text
    streamed = [json.loads(line) for line in (run_dir / ROWS).read_text().splitlines()]
    assert [r["bytes"] for r in streamed] == [1024, 2048, 4096]
    lines = text.splitlines()
    assert sum(line.startswith("op ") for line in lines) == 1
    rows = [line for line in lines if line.startswith("all_reduce")]
    assert len(rows) == 3
    summary = next(i for i, line in enumerate(lines) if line.startswith("gloo on 2 ranks"))
    assert lines.index(rows[-1]) < summary
