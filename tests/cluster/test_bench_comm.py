"""The comm benchmark on the real namespaced cluster: busbw by size, raw TCP between two
nodes, and the ratio of the two."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.cluster.slurm_final import assert_completed
from tests.cluster.test_slurm_submit import job_id_of

pytestmark = pytest.mark.cluster
Run = Callable[..., subprocess.CompletedProcess[str]]


def test_busbw_by_size_and_ratio_to_raw_tcp(hpc_ddp: Run, slurm_env: dict[str, str],
                                            tmp_path: Path) -> None:
    run_dir = tmp_path / "bench"
    done = hpc_ddp("bench", ["comm", "--min-size", "256K", "--max-size", "2MiB",
                             "--tcp-seconds", "2", "--iters", "5", "cluster=slurm", "nodes=2",
                             "cluster.tasks_per_node=2", f"run_dir={run_dir}"],
                   env=slurm_env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert_completed(job_id_of(done.stdout), slurm_env, done.stdout)
    result = json.loads((run_dir / "bench" / "comm.json").read_text())
    assert result["world_size"] == 4 and result["backend"] == "gloo"
    assert len(set(result["hosts"])) == 2
    sizes = [256 * 2**10, 512 * 2**10, 2**20, 2 * 2**20]
    for op, factor in (("all_reduce", 1.5), ("all_gather", 0.75), ("reduce_scatter", 0.75)):
        rows = [r for r in result["rows"] if r["op"] == op]
        assert [r["bytes"] for r in rows] == sizes
        for r in rows:  # nccl-tests' definitions, n = 4
            assert r["correct"] and r["time_us"] > 0
            assert r["algbw_gbps"] == pytest.approx(r["bytes"] / (r["time_us"] * 1e-6) / 1e9)
            assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * factor)
    tcp = result["tcp"]
    # Rank 0 (first node) streamed to the first rank of the other node, across the bridge.
    assert tcp["from_host"] != tcp["to_host"] and tcp["to_rank"] == 2 and not tcp["same_host"]
    assert tcp["gbps"] > 0 and tcp["bytes"] > 0
    ratio = result["ratio"]["all_reduce"]
    assert ratio["ratio"] == pytest.approx(ratio["busbw_gbps"] / tcp["gbps"])
    out = done.stdout
    assert f"raw TCP {tcp['from_host']} -> {tcp['to_host']}" in out
    assert f"gloo all_reduce busbw at 2 MiB: {ratio['busbw_gbps']:.3f} GB/s = " \
           f"{ratio['ratio']:.2f} x raw TCP" in out
    assert sum(line.startswith("all_reduce ") for line in out.splitlines()) == len(sizes)
    assert (run_dir / "bench" / "comm.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
