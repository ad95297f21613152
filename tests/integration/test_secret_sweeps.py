"""A swept secret typed on the submit command's command line (`-m app.api_token=A,B`): the
command starts itself again with each value replaced by a reference of its own, so while the
points train no command line of the machine (the waiting submit command's included: what
ps shows every user) holds a value, and each point's rank still gets its own."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO, command_env
from tests.integration.test_secrets import files_holding, sha

PLANTED = {"model.api_token": "planted-swept-model-51a0",
           "app.api_token#0": "planted-swept-a-0c11", "app.api_token#1": "planted-swept-b-9e22"}


def test_a_swept_secret_typed_on_the_command_line_reaches_each_point_and_no_argv(
        tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    planted = tmp_path / "planted.json"
    planted.write_text(json.dumps(PLANTED))
    done = subprocess.run(
        [sys.executable, "-m", "hpc_ddp.submit", "-m", "cluster=local",
         "cluster.tasks_per_node=1", "entry=tests.usercode.entries:secrets_reached",
         "model._target_=tests.usercode.parts.model_with_token",
         f"model.api_token={PLANTED['model.api_token']}",
         f"app.api_token={PLANTED['app.api_token#0']},{PLANTED['app.api_token#1']}",
         "sweep.parallel=2", f"sweep.dir={sweep}"],
        capture_output=True, text=True, timeout=600, cwd=REPO, check=False,
        env=command_env({"PLANTED_FILE": str(planted)}))
    assert done.returncode == 0, done.stdout + done.stderr
    for point in (0, 1):
        summary = json.loads((sweep / f"{point:03d}" / "summary.json").read_text())
        reached = summary["result"]["sha256"]
        assert reached["app.api_token"] == sha(PLANTED[f"app.api_token#{point}"]), point
        assert reached["model.api_token"] == sha(PLANTED["model.api_token"])
        # read while both points ran: the submit command's argv (restarted) holds none
        assert summary["result"]["argv_holding"] == []
        overrides = (sweep / f"{point:03d}" / "overrides.yaml").read_text()
        assert f"${{oc.env:HPC_DDP_SECRET_APP_API_TOKEN_{point}}}" in overrides, overrides
    values = list(PLANTED.values())
    assert files_holding(sweep, values) == []
    assert not [v for v in values if v in done.stdout + done.stderr]
    manifest = json.loads((sweep / "sweep.json").read_text())
    assert [p["params"]["app.api_token"] for p in manifest["points"]] == ["****"] * 2
