"""A secret given on the command line, in a setup line or in the environment reaches the
ranks, and no file of the run dir (submitit's folder included) and no printed line holds it."""

from __future__ import annotations

import hashlib
import json
import subprocess
from collections.abc import Callable
from pathlib import Path

Run = Callable[..., subprocess.CompletedProcess[str]]
# Planted values: long enough to be unmistakable in any file, binary ones included.
PLANTED = {"WANDB_API_KEY": "planted-setup-7f3a9c21", "HF_TOKEN": "planted-extra-91bc44e0",
           "MY_SERVICE_PASSWORD": "planted-env-55de0b17"}


def files_holding(root: Path, values: list[str]) -> list[str]:
    """Every file under ``root`` that holds one of ``values`` (bytes, any format)."""
    found = []
    for path in root.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            found += [f"{path.relative_to(root)}: {v}" for v in values if v.encode() in data]
    return found


def sha(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


def test_secrets_reach_the_ranks_and_no_file_or_line_holds_them(hpc_ddp: Run,
                                                                tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = ["cluster=local", "entry=tests.usercode.entries:secrets_seen",
            f"cluster.setup=['export WANDB_API_KEY={PLANTED['WANDB_API_KEY']}']",
            f"+nccl.extra_env.HF_TOKEN={PLANTED['HF_TOKEN']}", f"run_dir={run_dir}"]
    done = hpc_ddp("submit", args, env={"MY_SERVICE_PASSWORD": PLANTED["MY_SERVICE_PASSWORD"]})
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    # Every secret reached rank 0, the literal ones through the launch's environment.
    assert summary["sha256"] == {k: sha(v) for k, v in PLANTED.items()}
    assert files_holding(run_dir, list(PLANTED.values())) == []
    printed = done.stdout + done.stderr
    assert not [v for v in PLANTED.values() if v in printed]
    config = (run_dir / "config.yaml").read_text()
    assert "export WANDB_API_KEY=${oc.env:WANDB_API_KEY}" in config
    assert "HF_TOKEN: ${oc.env:HF_TOKEN}" in config
    assert "careless: HF_TOKEN is ****" in (run_dir / "logs" / "rank0.log").read_text()
    assert "${oc.env:HF_TOKEN}" in (run_dir / "overrides.yaml").read_text()
