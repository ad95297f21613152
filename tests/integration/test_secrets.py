"""A secret given through each channel (a setup line, NCCL's and the submitting shell's
environment, a `_target_` part's argument, a swept key, a script's arguments) reaches the
ranks, and no file of the run or sweep dir (submitit's folder included), no printed line and
no command line of the node (what ps shows every user) holds it."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO, command_env

# Planted values: long enough to be unmistakable in any file, binary ones included.
PLANTED = {"WANDB_API_KEY": "planted-setup-7f3a9c21", "HF_TOKEN": "planted-extra-91bc44e0",
           "MY_SERVICE_PASSWORD": "planted-env-55de0b17",
           "DB_PASSWORD": "$up3rS3cret-planted-3c",  # a literal that starts with $
           "model.api_token": "hf_plantedPartArgument0000",
           "app.api_token#0": "planted-sweep-a-0001", "app.api_token#1": "planted-sweep-b-0002"}
SCRIPT = {"--hf-token": "planted-arg-77aa11ee", "bare": "sk-plantedBareArgument000000"}
# The typed command's own values: until it starts itself again without them its command line
# holds them, and another test of this module may be looking at the machine's command lines
# in that moment (the suite runs them side by side).
TYPED = {"--hf-token": "planted-typed-arg-5c0e19", "bare": "sk-plantedTypedBare00000000"}
# Submitted from Python (the API's command, in-process), so that no command line of this
# machine holds the values from the start: the test checks that none does later.
SUBMIT = ("import json, sys; from hpc_ddp.submit import main; "
          "sys.exit(main(json.load(open(sys.argv[1]))))")


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


def submit(args: list[str], tmp_path: Path,
           env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    given = tmp_path / "args.json"
    given.write_text(json.dumps(args))
    planted = tmp_path / "planted.json"
    planted.write_text(json.dumps({**PLANTED, **SCRIPT}))
    done = subprocess.run([sys.executable, "-c", SUBMIT, str(given)], capture_output=True,
                          text=True, timeout=600, cwd=REPO, check=False, env=command_env(
                              {**env, "PLANTED_FILE": str(planted)}))
    given.unlink()
    return done


def channels(run_args: list[str], kind: str = "local") -> list[str]:
    return [f"cluster={kind}", *run_args,
            f"cluster.setup=['export WANDB_API_KEY={PLANTED['WANDB_API_KEY']}', "
            f"'export DB_PASSWORD=\\'{PLANTED['DB_PASSWORD']}\\'']",
            f"+nccl.extra_env.HF_TOKEN={PLANTED['HF_TOKEN']}",
            "model._target_=tests.usercode.parts.model_with_token",
            f"model.api_token={PLANTED['model.api_token']}"]


def test_secrets_reach_the_ranks_and_no_file_line_or_command_line_holds_them(
        tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    done = submit(["-m", *channels(["entry=tests.usercode.entries:secrets_reached"]),
                   f"app.api_token={PLANTED['app.api_token#0']},{PLANTED['app.api_token#1']}",
                   "sweep.parallel=2", f"sweep.dir={sweep}"], tmp_path,
                  {"MY_SERVICE_PASSWORD": PLANTED["MY_SERVICE_PASSWORD"]})
    assert done.returncode == 0, done.stdout + done.stderr
    planted = [*PLANTED.values(), *SCRIPT.values()]
    for point in (0, 1):
        summary = json.loads((sweep / f"{point:03d}" / "summary.json").read_text())
        reached = summary["result"]["sha256"]
        for name in ("WANDB_API_KEY", "HF_TOKEN", "MY_SERVICE_PASSWORD", "DB_PASSWORD",
                     "model.api_token"):
            assert reached[name] == sha(PLANTED[name]), name
        assert reached["app.api_token"] == sha(PLANTED[f"app.api_token#{point}"])
        assert summary["result"]["argv_holding"] == []
        assert "careless: ****" in (sweep / f"{point:03d}" / "logs" / "rank0.log").read_text()
    assert files_holding(sweep, planted) == []
    assert not [v for v in planted if v in done.stdout + done.stderr]
    manifest = json.loads((sweep / "sweep.json").read_text())
    assert [p["params"] for p in manifest["points"]] == [{"app.api_token": "****"}] * 2
    config = (sweep / "000" / "config.yaml").read_text()
    assert "export WANDB_API_KEY=${oc.env:WANDB_API_KEY}" in config
    assert "api_token: ${oc.env:HPC_DDP_SECRET_MODEL_API_TOKEN}" in config


def test_a_scripts_secret_arguments_reach_it_and_no_command_line(tmp_path: Path) -> None:
    out = tmp_path / "seen"
    run_dir = tmp_path / "run"
    done = submit(["cluster=local", "script=tests/usercode/secret_script.py",
                   f"run_dir={run_dir}", "--", str(out), "--hf-token", SCRIPT["--hf-token"],
                   "--epochs", "1", SCRIPT["bare"]], tmp_path, {})
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in (0, 1):
        seen = json.loads(Path(f"{out}.{rank}").read_text())
        assert seen == {"hf_token": sha(SCRIPT["--hf-token"]), "bare": sha(SCRIPT["bare"]),
                        "argv_holding": []}
    assert files_holding(run_dir, list(SCRIPT.values())) == []
    assert not [v for v in SCRIPT.values() if v in done.stdout + done.stderr]
    # The store's key (which the script's process group joined with): in the rendezvous
    # file, readable by the user alone, and nowhere else.
    [published] = (run_dir / "rendezvous").glob("*-r0.json")
    key = json.loads(published.read_text())["key"]
    assert published.stat().st_mode & 0o777 == 0o600
    assert files_holding(run_dir, [key]) == [f"{published.relative_to(run_dir)}: {key}"]
    import yaml

    args = yaml.safe_load((run_dir / "config.yaml").read_text())["script_args"]
    assert args == [str(out), "--hf-token", "${oc.env:HPC_DDP_SECRET_ARG_HF_TOKEN}", "--epochs",
                    "1", "${oc.env:HPC_DDP_SECRET_ARG_5}"]


FAILURE_TOKEN = "planted-failure-4d2e8a61"
SCRIPT_TOKEN = "hf_plantedRejectedArgument0"


def test_a_secret_in_an_error_message_is_masked_everywhere(tmp_path: Path) -> None:
    """A function entry raises with its app.api_token in the message; a script's argparse
    rejects a --hf-token flag and echoes it: the failure is reported, recorded and pickled
    (events.jsonl, logs/rank*.error, the failure's lines file, submitit's result pickle,
    the console), and the literal is in none of them."""
    for args in (
            ["entry=tests.usercode.entries:fails_with_its_token",
             f"app.api_token={FAILURE_TOKEN}", "cluster=local", "cluster.tasks_per_node=1",
             f"run_dir={tmp_path / 'entry'}"],
            ["script=tests/usercode/strict_script.py", "cluster=local",
             "cluster.tasks_per_node=1", f"run_dir={tmp_path / 'script'}", "--",
             "--hf-token", SCRIPT_TOKEN]):
        done = submit(args, tmp_path, {})
        assert done.returncode == 1, done.stdout + done.stderr
        said = done.stdout + done.stderr
        assert FAILURE_TOKEN not in said and SCRIPT_TOKEN not in said, said
        assert "****" in said or "auth failed" not in said
    assert "auth failed for ****" in (tmp_path / "entry" / "logs" / "rank0.error").read_text()
    script_error = (tmp_path / "script" / "logs" / "rank0.error").read_text()
    assert "unrecognized arguments: --hf-token ****" in script_error, script_error
    for run in ("entry", "script"):
        assert (tmp_path / run / "events.jsonl").read_text().count('"failure"') == 1
        assert list((tmp_path / run / "submitit").rglob("*_result.pkl"))
    assert files_holding(tmp_path, [FAILURE_TOKEN, SCRIPT_TOKEN]) == []


def test_the_command_typed_with_a_secret_does_not_keep_it_in_its_argv(tmp_path: Path) -> None:
    """`python -m hpc_ddp.submit ... -- --hf-token X` typed in a shell: the command starts
    itself again without the value, so while the run trains (the script looks then) no
    command line of the machine, the waiting submit command's included, holds it."""
    out = tmp_path / "seen"
    planted = tmp_path / "planted.json"
    planted.write_text(json.dumps(TYPED))
    done = subprocess.run(
        [sys.executable, "-m", "hpc_ddp.submit", "cluster=local",
         "script=tests/usercode/secret_script.py", f"run_dir={tmp_path / 'run'}", "--",
         str(out), "--hf-token", TYPED["--hf-token"], "-p", "planted-short-flag-31",
         TYPED["bare"]],
        capture_output=True, text=True, timeout=600, cwd=REPO, check=False,
        env=command_env({"PLANTED_FILE": str(planted)}))
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in (0, 1):
        seen = json.loads(Path(f"{out}.{rank}").read_text())
        assert seen["hf_token"] == sha(TYPED["--hf-token"]) and seen["argv_holding"] == []
    assert files_holding(tmp_path / "run", [*TYPED.values(), "planted-short-flag-31"]) == []
