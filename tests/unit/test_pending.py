"""A pending Slurm job as the user meets it: wait=true / Run.wait says why it waits and stops
at a reason meaning "never"; status shows the reason, --watch ends, --cancel says the job
never started. Real code paths against fake Slurm commands printing recorded output."""

from __future__ import annotations

import io
import json
import stat
from pathlib import Path

import pytest

from hpc_ddp.api import Run, RunFailed
from hpc_ddp.config.compose import to_yaml
from hpc_ddp.watch.follow import RunView, follow
from hpc_ddp.watch.status import finished, main, render
from tests.unit.slurm_records import SINFO_2205, calls, fake_slurm
from tests.unit.test_slurm_fit import cfg_of


def slurm_run(folder: Path, job_id: str = "2", nodes: int = 8) -> Run:
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(to_yaml(cfg_of(nodes)))
    record = {"kind": "slurm", "job_id": job_id}
    (folder / "job.json").write_text(json.dumps(record))
    return Run(folder, record)


def never_starting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Run, Path]:
    """A Slurm run whose job pends for a partition too small for it (squeue says so)."""
    folder, log = fake_slurm(tmp_path / "bin", {"squeue": "2|PENDING|PartitionNodeLimit|normal",
                                                "sacct": "", "sinfo": SINFO_2205})
    monkeypatch.setenv("PATH", str(folder))
    return slurm_run(tmp_path / "run"), log


def test_wait_stops_at_a_job_that_can_never_start(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    run, log = never_starting(tmp_path, monkeypatch)
    out = io.StringIO()
    with pytest.raises(RunFailed) as info:
        run.wait(out=out)
    said = ("job 2 can never start (PartitionNodeLimit): partition normal has 4 nodes, the job "
            "asks for 8: nodes=4")
    assert str(info.value) == said
    assert said in out.getvalue() and "--cancel" in out.getvalue()
    assert [c.split()[0] for c in calls(log)] == ["squeue", "sinfo"]
    pending = run.pending_reason()
    assert pending is not None and pending.never and pending.fix == "nodes=4"
    assert run.state == "PENDING" and run.job_state().reason == "PartitionNodeLimit"


def _sequence(folder: Path, name: str, outputs: list[tuple[str, int]], log: Path) -> None:
    """A fake command printing outputs[i] (text, exit code) on its i-th call, then the last."""
    for i, (text, _) in enumerate(outputs):
        (folder / f"{name}.{i}").write_text(text)
    cases = "".join(f"  {i}) /bin/cat {folder}/{name}.{i}; exit {code};;\n"
                    for i, (_, code) in enumerate(outputs[:-1]))
    last = len(outputs) - 1
    script = (f"#!/bin/sh\necho \"{name} $*\" >> {log}\nn=$(/bin/cat {folder}/{name}.n "
              f"2>/dev/null || echo 0)\necho $((n+1)) > {folder}/{name}.n\ncase $n in\n{cases}"
              f"  *) /bin/cat {folder}/{name}.{last}; exit {outputs[-1][1]};;\nesac\n")
    path = folder / name
    path.write_text(script)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_following_one_job_costs_one_call_a_refresh(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    folder, log = fake_slurm(tmp_path / "bin", {"sinfo": SINFO_2205})
    held = "2|PENDING|JobHeldUser|normal"
    _sequence(folder, "squeue", [(held, 0), (held, 0), ("2|RUNNING|None|normal", 0), ("", 1)],
              log)
    _sequence(folder, "sacct", [("2|COMPLETED|0:0|None", 0)], log)
    monkeypatch.setenv("PATH", str(folder))
    run = slurm_run(tmp_path / "run", nodes=1)
    (run.run_dir / "summary.json").write_text(json.dumps({"global_step": 5, "world_size": 1}))
    out = io.StringIO()
    assert follow(RunView(run), run.files, out, poll_s=0.01) == 0
    text = out.getvalue()
    assert text.count("pending: waits (JobHeldUser): held") == 1  # said once, not per poll
    assert "results:" in text
    # A refresh: one squeue while the job is queued or running; sacct once, at its end, and
    # once for what the run cost (runcost.finish: every start of every job of the run).
    assert [c.split()[0] for c in calls(log)] == ["squeue"] * 4 + ["sacct"] * 2


def test_status_shows_the_reason_and_watch_ends_at_never(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    run, log = never_starting(tmp_path, monkeypatch)
    out = io.StringIO()
    assert main([str(run.run_dir), "--watch", "--interval", "0.01"], out=out) == 0
    text = out.getvalue()
    assert "PENDING (PartitionNodeLimit)" in text
    assert ("job 2 can never start (PartitionNodeLimit): partition normal has 4 nodes, the job "
            "asks for 8: nodes=4") in text
    # one refresh: squeue, sacct (what it cost so far), sinfo for the partition's nodes
    assert [c.split()[0] for c in calls(log)] == ["squeue", "sacct", "sinfo"]
    out = io.StringIO()
    assert main([str(run.run_dir), "--json"], out=out) == 0
    row = json.loads(out.getvalue())["runs"][0]
    assert row["state"] == "PENDING" and row["reason"] == "PartitionNodeLimit"
    assert row["never"] is True and row["slurm_state"] == "PENDING"


def test_cancel_says_the_job_never_started(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    folder, log = fake_slurm(tmp_path / "bin", {"squeue": "2|PENDING|PartitionNodeLimit|normal",
                                                "sacct": "", "sinfo": SINFO_2205,
                                                "scancel": ""})
    monkeypatch.setenv("PATH", str(folder))
    run = slurm_run(tmp_path / "run")
    out = io.StringIO()
    assert main([str(run.run_dir), "--cancel"], out=out) == 0
    said = out.getvalue()
    assert "before it ever started: nothing trained, nothing to resume" in said, said
    assert "first: nodes=4" in said and "resume=true" in said
    assert "scancel 2" in calls(log)
    # A requeued job is PENDING too, but it ran: its checkpoint is there to continue from.
    (run.run_dir / "checkpoints").mkdir()
    out = io.StringIO()
    main([str(run.run_dir), "--cancel"], out=out)
    assert "continue it with" in out.getvalue() and "ever started" not in out.getvalue()


def test_rows_that_can_never_start_end_a_watch_and_are_named_together() -> None:
    base = {"run_dir": "/r", "restarts": 0, "step": None, "total_steps": None, "loss": None,
            "eval_accuracy": None, "eval_loss": None, "slurm_state": "PENDING"}
    never = "can never start (PartitionNodeLimit): partition normal has 4 nodes, the job asks " \
            "for 8: nodes=4"
    rows = [{**base, "label": f"p{i}", "job_id": f"9_{i}", "state": "PENDING",
             "reason": "PartitionNodeLimit", "pending": never, "never": True} for i in range(8)]
    rows.append({**base, "label": "p8", "job_id": "10", "state": "CANCELLED", "reason": "",
                 "pending": None, "never": False, "slurm_state": "CANCELLED by 0"})
    assert finished(rows)
    text = render(rows, is_sweep=True)
    assert f"p0, p1, p2, ... p7 (8 points): {never}" in text
    assert "CANCELLED" in text and "CANCELLED (" not in text
    rows[0] = {**rows[0], "never": False, "pending": "waits (Priority): for its turn",
               "reason": "Priority"}
    assert not finished(rows)
