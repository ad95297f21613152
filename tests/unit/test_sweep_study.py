"""An adaptive sweep's settings from the command line and a trial's value
(hpc_ddp/sweep/study.py): the plugin's keys, ours, and what is refused."""

from __future__ import annotations

import json
import os

import pytest

from hpc_ddp.errors import UserError
from hpc_ddp.sweep import study as studies

OTHER_UID = 4242  # a second user, made with chown (the tests run as root)


def test_the_plugins_keys_and_the_trials_overrides_are_told_apart() -> None:
    spec, rest = studies.split([
        "hydra/sweeper=optuna", "optim.lr=interval(0.001, 0.1)", "hydra.sweeper.n_trials=64",
        "hydra.sweeper.n_jobs=8", "hydra.sweeper.direction=maximize",
        "hydra.sweeper.sampler._target_=optuna.samplers.TPESampler",
        "hydra.sweeper.sampler.seed=123", "hydra.sweeper.pruner=hyperband",
        "hydra.sweeper.params.trainer.batch_size=choice(32, 64)", "nodes=2"])
    assert (spec.n_trials, spec.n_jobs, spec.direction) == (64, 8, ("maximize",))
    assert spec.sampler == {"_target_": "optuna.samplers.TPESampler", "seed": 123}
    assert spec.pruner == "hyperband" and spec.objective == ("eval/accuracy",)
    assert spec.params == {"trainer.batch_size": "choice(32, 64)"}
    assert rest == ["optim.lr=interval(0.001, 0.1)", "nodes=2"]
    # The study's settings travel as JSON (study.json) and come back the same.
    assert studies.StudySpec.from_json(spec.to_json()) == spec


def test_defaults_and_several_objectives() -> None:
    spec, _ = studies.split(["hydra/sweeper=optuna", "a=interval(0, 1)"])
    assert (spec.n_trials, spec.n_jobs, spec.direction, spec.objective) == (
        20, 2, ("minimize",), ("eval/loss",))
    spec, _ = studies.split(["hydra.sweeper.direction=[minimize,maximize]",
                             "sweep.objective=eval/loss,eval/accuracy"])
    assert spec.direction == ("minimize", "maximize")
    assert spec.objective == ("eval/loss", "eval/accuracy")


@pytest.mark.parametrize("override, said", [
    ("hydra/sweeper=basic", "is not a sweeper hpc_ddp runs"),
    ("hydra.sweeper.n_trials=0", "must be a whole number of 1 or more"),
    ("hydra.sweeper.n_jobs=two", "must be a whole number of 1 or more"),
    ("hydra.sweeper.n_trails=5", "is not a key of the Optuna sweeper"),
    ("hydra.sweeper.n_jobs.x=1", "hydra.sweeper.n_jobs has no keys of its own"),
    ("hydra.sweeper.direction=up", "is not a direction"),
])
def test_bad_settings_are_refused_by_name(override: str, said: str) -> None:
    with pytest.raises(UserError, match=said):
        studies.split(["hydra/sweeper=optuna", override])


def test_a_trials_value_from_its_evaluation_an_entry_or_nothing() -> None:
    spec, _ = studies.split(["sweep.objective=eval/accuracy", "hydra.sweeper.direction=maximize"])
    summary = {"eval_metrics": {"loss": 0.3, "accuracy": 0.9}}
    assert studies.objective_values(spec, summary)[0] == [0.9]
    assert studies.objective_values(spec, {}, 0.7)[0] == [0.7]  # an entry's number
    assert studies.objective_values(spec, {}, {"eval/accuracy": 0.8})[0] == [0.8]
    values, said = studies.objective_values(spec, {"eval_metrics": {"loss": 0.3}})
    assert values is None and "reported no eval/accuracy (its evaluations: eval/loss" in said
    assert studies.objective_values(spec, {"eval_metrics": {"accuracy": float("nan")}})[0] is None


def test_an_hparams_search_file_is_used_unchanged(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from tests.unit.test_sweep_space import TEMPLATE

    (tmp_path / "hparams_search").mkdir()
    (tmp_path / "hparams_search" / "mnist_optuna.yaml").write_text(TEMPLATE)
    spec, rest = studies.split([f"config_dir={tmp_path}", "hparams_search=mnist_optuna",
                                "hydra.sweeper.n_trials=8", "entry=pkg.train:main"])
    assert (spec.n_trials, spec.n_jobs, spec.direction) == (8, 1, ("maximize",))  # line wins
    assert spec.sampler == {"_target_": "optuna.samplers.TPESampler", "seed": 1234,
                            "n_startup_trials": 10}
    assert spec.params["model.optimizer.lr"] == "interval(0.0001, 0.1)"
    assert spec.objective == ("val/acc_best",)
    assert rest == [f"config_dir={tmp_path}", "entry=pkg.train:main"]
    with pytest.raises(UserError, match="is not a file hparams_search/nope.yaml"):
        studies.split([f"config_dir={tmp_path}", "hparams_search=nope"])


def test_the_workers_job_array_asks_for_a_trials_shape(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from hpc_ddp.api import compose
    from hpc_ddp.sweep.workers_job import script

    cfg = compose(["cluster=slurm", "nodes=2", "cluster.partition=gpu", "cluster.gpus_per_node=4",
                   "cluster.time_min=90", "cluster.setup=[module load cuda]"])
    text = script(cfg, tmp_path, 8, python="/env/bin/python")
    for line in ("#SBATCH --array=0-7", "#SBATCH --nodes=2", "#SBATCH --partition=gpu",
                 "#SBATCH --gpus-per-node=4", "#SBATCH --time=90", "#SBATCH --requeue",
                 "#SBATCH --signal=USR2@120", "module load cuda",
                 f'exec /env/bin/python -m hpc_ddp.sweep.worker {tmp_path} "$SLURM_ARRAY_TASK_ID"'):
        assert line in text.splitlines(), (line, text)


@pytest.mark.skipif(os.geteuid() != 0, reason="making a second user's files needs root")
def test_a_study_another_user_could_have_written_is_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # study.json names the storage every worker and every trial's rank 0 opens; the journal
    # holds the trials they run: a second user's file, or a folder others can write, is not
    # used (owned.py), and the message says how to go on.
    folder = tmp_path / "study"
    folder.mkdir(mode=0o750)
    spec, _ = studies.split(["optim.lr=interval(0.001, 0.1)"])
    (folder / studies.STUDY).write_text(json.dumps({"spec": spec.to_json()}))
    assert studies.StudySpec.from_json(studies.read_study(folder)["spec"]) == spec  # type: ignore[index]
    os.chown(folder / studies.STUDY, OTHER_UID, OTHER_UID)
    with pytest.raises(UserError, match="is not yours.*Fix: run the sweep in a folder"):
        studies.read_study(folder)
    os.chown(folder / studies.STUDY, 0, 0)
    folder.chmod(0o770)
    with pytest.raises(UserError, match="writable by your group"):
        studies.read_study(folder)
    folder.chmod(0o750)
    journal = folder / studies.JOURNAL
    journal.write_text("")
    os.chown(journal, OTHER_UID, OTHER_UID)
    with pytest.raises(UserError, match=r"hydra.sweeper.storage=journal:.*is not yours"):
        studies.storage(f"journal:{journal}")
