"""The doctor and the comm benchmark on cluster=local, as a user runs them."""

from __future__ import annotations

import json
import socket
import subprocess
from collections.abc import Callable
from pathlib import Path

Run = Callable[..., subprocess.CompletedProcess[str]]


def test_doctor_healthy_local_run(hpc_ddp: Run, tmp_path: Path) -> None:
    run_dir = tmp_path / "doc"
    done = hpc_ddp("doctor", ["--size-mib", "1", "cluster=local", "nodes=2",
                              "cluster.tasks_per_node=1", f"run_dir={run_dir}"])
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((run_dir / "doctor.json").read_text())
    host = socket.gethostname()
    assert report["ok"] and report["nodes"] == {f"{host}#0": [0], f"{host}#1": [1]}
    import torch

    facts = report["facts"]
    assert [f["rank"] for f in facts] == [0, 1]
    assert {f["torch"] for f in facts} == {torch.__version__}
    assert report["allreduce"]["correct"] and report["allreduce"]["bytes"] == 2**20
    header = next(line for line in done.stdout.splitlines() if line.startswith("node "))
    assert header.split() == ["node", "ranks", "python", "torch", "cuda", "nccl", "cudnn",
                              "gpus", "ib", "ports", "peermem", "status"]
    assert "doctor: ok, 2 node(s), 2 rank(s)." in done.stdout
    assert (run_dir / "ranks" / "rank1.json").is_file()  # the same per-rank records as training


def test_doctor_blames_the_configuration_when_every_node_fails(hpc_ddp: Run,
                                                               tmp_path: Path) -> None:
    run_dir = tmp_path / "doc"
    done = hpc_ddp("doctor", ["--size-mib", "0.25", "cluster=local", "nodes=2",
                              "cluster.tasks_per_node=1", "nccl.socket_ifname='=nosuch0'",
                              f"run_dir={run_dir}"])
    assert done.returncode == 1, done.stdout + done.stderr
    report = json.loads((run_dir / "doctor.json").read_text())
    assert report["bad_nodes"] == []
    [problem] = [p for p in report["problems"] if p["level"] == "fail"]
    assert "NCCL_SOCKET_IFNAME==nosuch0 matches no interface" in problem["message"]
    assert problem["scope"] == "job"
    assert "fix the configuration" in done.stdout and "cluster.exclude" not in done.stdout


def test_doctor_bad_input_exits_2(hpc_ddp: Run, tmp_path: Path) -> None:
    done = hpc_ddp("doctor", ["cluster=local", "nccl=infiniband", "nccl.ib_timeout=40",
                              f"run_dir={tmp_path}/doc"])
    assert done.returncode == 2
    assert done.stderr.startswith("error: nccl.ib_timeout=40: NCCL_IB_TIMEOUT must be an "
                                  "integer 1-31")
    assert not (tmp_path / "doc").exists()


def test_bench_comm_local(hpc_ddp: Run, tmp_path: Path) -> None:
    run_dir = tmp_path / "bench"
    done = hpc_ddp("bench", ["comm", "--max-size", "64K", "--min-size", "16K",
                             "--tcp-seconds", "0.5", "--iters", "3", "cluster=local",
                             f"run_dir={run_dir}"])
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((run_dir / "bench" / "comm.json").read_text())
    assert result["world_size"] == 2
    assert [(r["op"], r["bytes"]) for r in result["rows"]] == [
        (op, size) for op in ("all_reduce", "all_gather", "reduce_scatter")
        for size in (16 * 2**10, 32 * 2**10, 64 * 2**10)]
    assert all(r["correct"] for r in result["rows"])
    # One host: the TCP reference is loopback, and says so.
    assert result["tcp"]["same_host"] and "raw TCP same host (loopback)" in done.stdout
    assert "x raw TCP" in done.stdout
    assert (run_dir / "bench" / "comm.png").is_file()


def test_preflight_entry_for_submit(tmp_path: Path) -> None:
    """What submit calls for preflight=true: the resolved training config, its run dir."""
    import io
    import os

    from hpc_ddp.config.compose import compose
    from hpc_ddp.doctor import DoctorOptions, preflight
    from hpc_ddp.launch.resolve import resolve

    cfg = resolve(compose(["cluster=local", f"run_dir={tmp_path / 'train'}"]), os.environ,
                  tmp_path)
    out = io.StringIO()
    assert preflight(cfg, tmp_path / "train", out, DoctorOptions(size_mib=0.25, iters=2))
    [folder] = (tmp_path / "train" / "preflight").iterdir()
    report = json.loads((folder / "doctor.json").read_text())
    assert report["ok"] and report["world_size"] == 2
    assert "doctor: ok" in out.getvalue()
    # A second preflight (e.g. on resume) gets a folder of its own.
    assert preflight(cfg, tmp_path / "train", out, DoctorOptions(size_mib=0.25, iters=2))
    assert len(list((tmp_path / "train" / "preflight").iterdir())) == 2
