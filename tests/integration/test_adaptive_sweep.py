"""Adaptive sweeps without Slurm (hydra/sweeper=optuna): a real Optuna study in the sweep
folder's journal file, workers that never wait for a batch, a real pruner stopping trials from
the trainer's own evaluations, and bad input refused in one line."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import optuna
import pytest

from hpc_ddp.sweep.study import JOURNAL

Run = Callable[..., subprocess.CompletedProcess[str]]
SMALL = ["cluster=local", "data.train_size=512", "data.eval_size=128", "trainer.log_interval=5"]


def study_of(folder: Path) -> optuna.Study:
    from optuna.storages.journal import JournalFileBackend

    storage = optuna.storages.JournalStorage(JournalFileBackend(str(folder / JOURNAL)))
    return optuna.load_study(study_name=folder.name, storage=storage)


def test_workers_take_the_next_trial_without_waiting_for_a_batch(hpc_ddp: Run,
                                                                 tmp_path: Path) -> None:
    # Two workers, a grid of a short and two long trials. A grid sampler's seed orders the
    # grid and trial n takes its point n: with seed 10, trial 0 is the short one and trial
    # 1 a long one. Batched, trial 2 would wait for both of the first two; here the short
    # trial's worker takes it while the long one trains.
    sweep = tmp_path / "study"
    done = hpc_ddp("submit", ["-m", "hydra/sweeper=optuna",
                              "trainer.max_steps=choice(10, 400, 401)",
                              "hydra.sweeper.sampler=grid", "hydra.sweeper.sampler.seed=10",
                              "hydra.sweeper.n_trials=5",
                              "hydra.sweeper.n_jobs=2", "trainer.eval_interval=0",
                              *SMALL, f"sweep.dir={sweep}"], timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    trials = study_of(sweep).trials
    # n_trials=5, but a grid's end ends the study (as Optuna's optimize does): 3 trials.
    assert [t.state.name for t in trials] == ["COMPLETE"] * 3, done.stdout
    short, long = trials[0], trials[1]
    assert short.params["trainer.max_steps"] == 10 and long.params["trainer.max_steps"] > 10
    assert short.datetime_complete <= trials[2].datetime_start < long.datetime_complete
    # Each trial's value is its run's own last evaluation, in its own run dir.
    for trial in trials:
        summary = json.loads((sweep / f"trial-{trial.number}" / "summary.json").read_text())
        assert summary["global_step"] == trial.params["trainer.max_steps"]
        assert trial.value == pytest.approx(summary["eval_metrics"]["loss"])
    assert f"best: trial {min(trials, key=lambda t: t.value).number}" in done.stdout


def test_a_real_pruner_stops_a_hopeless_trial_at_its_evaluation(hpc_ddp: Run,
                                                                tmp_path: Path) -> None:
    # lr=1000 diverges: Optuna's ThresholdPruner prunes a NaN or a loss above 50 at the first
    # evaluation (step 10); the trial ends there with its checkpoint, PRUNED in the study.
    sweep = tmp_path / "study"
    done = hpc_ddp("submit", ["-m", "hydra/sweeper=optuna", "optim.lr=choice(0.05, 1000.0)",
                              "hydra.sweeper.sampler=grid", "hydra.sweeper.n_trials=2",
                              "hydra.sweeper.n_jobs=1", "hydra.sweeper.pruner=threshold",
                              "hydra.sweeper.pruner.upper=50", "trainer.max_steps=40",
                              "trainer.eval_interval=10", "trainer.checkpoint_interval=100",
                              *SMALL, f"sweep.dir={sweep}"], timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    states = {t.params["optim.lr"]: t for t in study_of(sweep).trials}
    assert states[0.05].state.name == "COMPLETE" and states[1000.0].state.name == "PRUNED"
    pruned = sweep / f"trial-{states[1000.0].number}"
    assert json.loads((pruned / "pruned.json").read_text())["step"] == 10
    summary = json.loads((pruned / "summary.json").read_text())
    assert summary["global_step"] == 10  # stopped there, and ended as a finished run does
    assert (pruned / "checkpoints" / "latest").exists()  # its checkpoint kept
    assert f"trial {states[1000.0].number}: pruned at step 10" in done.stdout
    # The picture in the sweep folder, and status's: the history and lr against the loss.
    assert (sweep / "study.png").stat().st_size > 5000
    status = hpc_ddp("status", [str(sweep), "--plot", str(tmp_path / "s.png")])
    assert status.returncode == 0, status.stderr
    assert "2 of 2 trials drawn, 1 complete, 1 pruned" in status.stdout
    assert "pruned at step 10" in status.stdout and (tmp_path / "s.png").stat().st_size > 5000
    # TensorBoard's HPARAMS tab: each trial's sampled values.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(sweep / f"trial-{states[0.05].number}" / "tb"))
    acc.Reload()
    assert "_hparams_/session_start_info" in acc.PluginTagToContent("hparams")
    assert_the_dashboard_serves(sweep, trials=2)


def assert_the_dashboard_serves(sweep: Path, trials: int) -> None:
    """optuna-dashboard on the study's journal file (docs/sweeps.md), over HTTP on the
    loopback: it lists the study and its trials."""
    import socket
    import sys
    import time
    import urllib.request

    with socket.socket() as probe:  # a free port on the loopback
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dashboard = Path(sys.executable).parent / "optuna-dashboard"
    server = subprocess.Popen([str(dashboard), str(sweep / JOURNAL), "--host", "127.0.0.1",
                               "--port", str(port), "--quiet"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies",
                                            timeout=5) as answer:
                    studies = json.load(answer)["study_summaries"]
                break
            except OSError:
                assert server.poll() is None, server.stderr.read() if server.stderr else ""
                assert time.monotonic() < deadline, "optuna-dashboard never answered"
                time.sleep(0.5)
        assert [s["study_name"] for s in studies] == [sweep.name]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies/"
                                    f"{studies[0]['study_id']}", timeout=10) as answer:
            assert len(json.load(answer)["trials"]) == trials
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.mark.parametrize("args, said", [
    (["optim.lr=interval(0.1, 0.001)"], "optim.lr=interval(0.1, 0.001): has its low (0.1)"),
    (["optim.lr=tag(log, interval(0, 1))"], "a log scale needs both bounds above 0"),
    (["optim.lr=interval(0.001, 0.1)", "hydra.sweeper.sampler=annealing"],
     "hydra.sweeper.sampler=annealing: is not one of Optuna's samplers"),
    (["optim.lr=interval(0.001, 0.1)", "sweep.objective=eval/loss,eval/accuracy"],
     "sweep.objective=eval/loss,eval/accuracy: names 2 metric(s)"),
    (["optim.lr=interval(0.001, 0.1)", "hydra.sweeper.n_trails=5"],
     "hydra.sweeper.n_trails=5: is not a key of the Optuna sweeper"),
    (["optim.lr=interval(0.001, 0.1)", "trainer.batch_size=-1"], "trainer.batch_size"),
    (["optim.lr=interval(0.001, 0.1)", "hydra.sweeper.storage='mysql+pymysql://nobody@localhost"
      "/none?unix_socket=/nonexistent/mysqld.sock'"], "cannot be opened: "),
])
def test_bad_input_is_one_line_and_exit_2_before_anything_starts(hpc_ddp: Run, tmp_path: Path,
                                                                 args: list[str],
                                                                 said: str) -> None:
    sweep = tmp_path / "study"
    done = hpc_ddp("submit", ["-m", "hydra/sweeper=optuna", *args, *SMALL,
                              f"sweep.dir={sweep}"], timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert said in done.stderr and "Traceback" not in done.stderr
    assert not sweep.exists()  # nothing was made


def script_study(hpc_ddp: Run, tmp_path: Path, values: str, *args: str
                 ) -> tuple[subprocess.CompletedProcess[str], Path]:
    """A local study whose trials run a torchrun-style script: rank 0 writes ``values`` (a
    Python expression of ``run``, its run dir, and os) to $HPC_DDP_RUN_DIR/objective.json."""
    script = tmp_path / "train.py"
    script.write_text("import json, os\n"
                      "run = os.environ['HPC_DDP_RUN_DIR']\n"
                      "if os.environ['RANK'] == '0':\n"
                      "    with open(os.path.join(run, 'objective.json'), 'w') as f:\n"
                      f"        json.dump({values}, f)\n")
    sweep = tmp_path / "study"
    done = hpc_ddp("submit", ["-m", "hydra/sweeper=optuna", "hydra.sweeper.n_jobs=1", *args,
                              f"script={script}", "cluster=local", f"sweep.dir={sweep}"],
                   timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done, sweep


def test_a_script_reports_its_value_with_no_import_of_ours(hpc_ddp: Run, tmp_path: Path) -> None:
    # A torchrun-style script run as a trial writes its value to $HPC_DDP_RUN_DIR/objective.json.
    _, sweep = script_study(hpc_ddp, tmp_path,
                            "{'eval/loss': 0.25 * int(os.environ['WORLD_SIZE'])}",
                            "trainer.seed=choice(1)", "hydra.sweeper.n_trials=1")
    (trial,) = study_of(sweep).trials
    assert trial.state.name == "COMPLETE" and trial.value == 0.5  # two local ranks


def test_several_objectives_a_real_nsga_ii_study_and_its_front(hpc_ddp: Run,
                                                               tmp_path: Path) -> None:
    # Trials whose two values trade off by the seed (a script writes both): seed 1 has the
    # lowest loss, seed 3 the highest accuracy, seed 2 neither. NSGA-II draws the seeds;
    # the front is what no other trial beats on both. (A trial's values: its hparams.json.)
    seed = "json.load(open(os.path.join(run, 'hparams.json')))['trainer.seed']"
    done, sweep = script_study(
        hpc_ddp, tmp_path, f"{{'eval/loss': {{1: 0.1, 2: 0.5, 3: 0.4}}[{seed}], "
        f"'eval/accuracy': {{1: 0.2, 2: 0.3, 3: 0.9}}[{seed}]}}",
        "trainer.seed=choice(1, 2, 3)", "hydra.sweeper.sampler=nsgaii",
        "hydra.sweeper.sampler.seed=4", "hydra.sweeper.n_trials=3",
        "hydra.sweeper.direction=[minimize,maximize]", "sweep.objective=eval/loss,eval/accuracy",
        "cluster.tasks_per_node=1")
    study = study_of(sweep)
    assert [len(t.values) for t in study.trials] == [2, 2, 2], done.stdout
    values = {1: (0.1, 0.2), 2: (0.5, 0.3), 3: (0.4, 0.9)}
    for t in study.trials:
        assert tuple(t.values) == values[t.params["trainer.seed"]]

    def beaten(t: optuna.trial.FrozenTrial) -> bool:
        return any(o.values[0] <= t.values[0] and o.values[1] >= t.values[1]
                   and o.values != t.values for o in study.trials)

    front = sorted(t.number for t in study.trials if not beaten(t))
    assert sorted(t.number for t in study.best_trials) == front
    said = done.stdout[done.stdout.index("best trade-offs"):]
    assert f"(the Pareto front of eval/loss, eval/accuracy, {len(front)} trial(s))" in said
    for t in study.best_trials:
        assert f"trial {t.number} (eval/loss, eval/accuracy = {t.values[0]:.6g}, " \
               f"{t.values[1]:.6g}): {sweep / f'trial-{t.number}'}" in said, said
    status = hpc_ddp("status", [str(sweep), "--json"], timeout=60)
    assert status.returncode == 0, status.stdout + status.stderr
    shown = json.loads(status.stdout)
    assert shown["best"] is None and sorted(shown["front"]) == front


def test_bench_search_compares_batches_asynchrony_and_pruning(hpc_ddp: Run,
                                                              tmp_path: Path) -> None:
    # A grid of four (seed 1: (5000, 1000), (500, 1000), (500, 0.05), (5000, 0.05), the best
    # last) on two workers, one rank each, of a user's own loop that reports its evaluations
    # every 100 steps (tests/usercode/entries.py:searched; the built-in trainer's pruning:
    # test_a_real_pruner_stops_a_hopeless_trial_at_its_evaluation). Its steps sleep 10 ms,
    # without training's CPU: a short trial lasts 5 s, a long one 50 s, a pruned one 1 s.
    # Batched, trial 1's worker waits for trial 0's 5000 diverging steps before trials 2 and
    # 3 start; asynchronously it goes on at once; pruned, the diverging lr=1000 trials stop
    # at their first evaluation instead of growing to inf (FAILED then: no finite loss), and
    # the best trial starts beside trial 2 instead of after it.
    out = tmp_path / "search"
    done = hpc_ddp("bench", ["search", f"--out={out}", "cluster=local",
                             "cluster.tasks_per_node=1", "entry=tests.usercode.entries:searched",
                             "app.steps=choice(500, 5000)", "app.lr=choice(0.05, 1000.0)",
                             "app.step_s=0.01", "app.eval_every=100", "sweep.objective=eval/loss",
                             "hydra.sweeper.sampler=grid",
                             "hydra.sweeper.sampler.seed=1", "hydra.sweeper.n_jobs=2",
                             "hydra.sweeper.pruner=threshold", "hydra.sweeper.pruner.upper=50"],
                   timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((out / "search.json").read_text())
    batched, eager, pruned = result["ways"]
    assert [w["trials"] for w in result["ways"]] == [4, 4, 4]
    assert [w["pruned"] for w in result["ways"]] == [0, 0, 2]
    for trial in (out / "pruned").glob("trial-*"):  # ctx.report told the loop, which ended
        if (trial / "pruned.json").exists():
            assert json.loads((trial / "summary.json").read_text())["result"]["pruned_at"] == 100
    assert batched["best"] == eager["best"] == pruned["best"] == result["target"]
    # The batched way's first worker idled through the long trial; asynchronously it did not.
    assert batched["idle_share"] > eager["idle_share"], result
    # Why each way is faster, from the studies' own start and end times (node-seconds are
    # printed, not compared: the ways run one after another, and under CI's changing load a
    # trial's start took 10 to 45 s, more than pruning saves, in one run and not the next):
    b, a, p = (study_of(out / name).trials for name in ("batched", "async", "pruned"))
    # batched, trials 2 and 3 wait for the batch's long trial 0;
    assert b[0].datetime_complete <= b[2].datetime_start, result
    assert b[0].datetime_complete <= b[3].datetime_start, result
    # asynchronously, trial 2 starts when trial 1 ends, while trial 0 trains on;
    assert a[1].datetime_complete <= a[2].datetime_start < a[0].datetime_complete, result
    # pruned, trials 0 and 1 (started together) end at their first evaluation, and trials 2
    # and 3 then run side by side: the best trial starts one short trial sooner.
    assert p[3].datetime_start < p[2].datetime_complete, result
    assert "batched (the plugin)" in done.stdout and "x batched" in done.stdout
