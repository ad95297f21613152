"""An adaptive sweep's search space and study parts from the Optuna sweeper plugin's syntax
(hpc_ddp/sweep/space.py, study_parts.py): real Optuna distributions, samplers and pruners."""

from __future__ import annotations

from typing import Any

import optuna
import pytest
import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from hpc_ddp.errors import UserError
from hpc_ddp.sweep import study_parts
from hpc_ddp.sweep.space import Space, search_space, trial_overrides, value_text

# The issue's own command line, as a user types it.
LINE = ["hydra/sweeper=optuna", "optim.lr=tag(log, interval(1e-4, 1e-1))",
        "optim=choice(sgd, adamw)", "hydra.sweeper.n_trials=64", "hydra.sweeper.n_jobs=8",
        "cluster=slurm", "nodes=1"]

# lightning-hydra-template's configs/hparams_search/mnist_optuna.yaml, unchanged.
TEMPLATE = """
# @package _global_
defaults:
  - override /hydra/sweeper: optuna
optimized_metric: "val/acc_best"
hydra:
  mode: "MULTIRUN"
  sweeper:
    _target_: hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper
    storage: null
    study_name: null
    n_jobs: 1
    direction: maximize
    n_trials: 20
    sampler:
      _target_: optuna.samplers.TPESampler
      seed: 1234
      n_startup_trials: 10
    params:
      model.optimizer.lr: interval(0.0001, 0.1)
      data.batch_size: choice(32, 64, 128, 256)
      model.net.lin1_size: choice(64, 128, 256)
      model.net.lin2_size: choice(64, 128, 256)
      model.net.lin3_size: choice(32, 64, 128, 256)
"""


def test_the_issues_command_line_is_a_space_and_fixed_overrides() -> None:
    space = search_space(LINE)
    assert space.params == {
        "optim.lr": FloatDistribution(1e-4, 0.1, log=True),
        "optim": CategoricalDistribution(("sgd", "adamw"))}
    # The sweeper's own settings are not trial parameters; the rest goes to every trial.
    assert space.fixed == ("cluster=slurm", "nodes=1")


@pytest.mark.parametrize("override, expected", [
    ("a=int(interval(32, 256))", IntDistribution(32, 256)),
    ("a=interval(1, 10)", FloatDistribution(1.0, 10.0)),  # Hydra reads interval as floats
    ("a=tag(log, int(interval(1, 1024)))", IntDistribution(1, 1024, log=True)),
    # range() as Python (and Hydra's grid sweeps) read it: 512 is not among its values.
    ("a=range(64, 512, 64)", IntDistribution(64, 448, step=64)),
    ("a=range(0.1, 0.5, 0.1)", FloatDistribution(0.1, 0.4, step=0.1)),
    ("a=shuffle(range(1, 4))", CategoricalDistribution((1, 2, 3))),
    ("a=1,2,3", CategoricalDistribution((1, 2, 3))),
    ("a=choice(true, false)", CategoricalDistribution((True, False))),
    ("a=choice([1,2], [3])", CategoricalDistribution(("[1,2]", "[3]"))),
])
def test_each_kind_of_sweep_becomes_its_distribution(override: str, expected: Any) -> None:
    dist = search_space([override]).params["a"]
    if isinstance(expected, FloatDistribution) and expected.step:
        assert (dist.low, dist.step, dist.log) == (expected.low, expected.step, expected.log)
        assert dist.high == pytest.approx(expected.high)
    else:
        assert dist == expected


def test_the_config_files_params_and_the_command_line_which_wins() -> None:
    params = yaml.safe_load(TEMPLATE)["hydra"]["sweeper"]["params"]
    space = search_space(["data.batch_size=choice(16, 32)", "trainer.max_steps=100"], params)
    assert space.params["model.optimizer.lr"] == FloatDistribution(0.0001, 0.1)
    assert space.params["model.net.lin3_size"] == CategoricalDistribution((32, 64, 128, 256))
    assert space.params["data.batch_size"] == CategoricalDistribution((16, 32))  # the line's
    assert list(space.params)[-1] == "data.batch_size" and space.fixed == (
        "trainer.max_steps=100",)


@pytest.mark.parametrize("override, said, fix", [
    ("optim.lr=interval(0.1, 0.0001)", "has its low (0.1) above its high (0.0001)",
     "swap them: optim.lr=interval(0.0001, 0.1)"),
    ("optim.lr=tag(log, interval(0, 0.1))", "a log scale needs both bounds above 0",
     "optim.lr=tag(log, interval(0.0001, 0.1))"),
    ("a=tag(log, int(interval(-5, 100)))", "a log scale needs both bounds above 0",
     "a=tag(log, int(interval(1, 100)))"),
    ("a=tag(exp, interval(1, 2))", "the only tag an adaptive sweep reads is log",
     "a=tag(log, interval(...))"),
    ("a=tag(log, choice(1, 2))", "puts a log scale on a list of choices", "tag(log, interval"),
    ("a=range(10, 1, 1)", "gives no values", "a=range(1, 10, 1)"),
    ("a=tag(log, range(1, 100, 2))", "a step or a log scale, not both",
     "a=tag(log, int(interval(1, 99)))"),
    ("a=interval(1, 2", "is not Hydra's override syntax", "key=interval(low, high)"),
])
def test_bad_input_is_one_line_naming_the_value_and_the_fix(override: str, said: str,
                                                            fix: str) -> None:
    with pytest.raises(UserError) as caught:
        search_space([override])
    message = caught.value.message
    assert override.partition("=")[0] in message and said in message and fix in message
    assert "\n" not in message


@pytest.mark.parametrize("value", ["sgd", "with space", "a,b", "it's", "true", "null", "1e-05",
                                   "inf", 0.0001, 1e-05, 3, True, None, [1, "x y"], {"k": 2}])
def test_a_sampled_value_comes_back_from_its_override_as_it_was(value: Any) -> None:
    override = OverridesParser.create().parse_overrides([f"k={value_text(value)}"])[0]
    assert override.value() == value


def test_a_trials_overrides_are_the_fixed_ones_then_its_values() -> None:
    space = search_space(LINE)
    assert trial_overrides(space, {"optim.lr": 0.00123, "optim": "adamw"}) == [
        "cluster=slurm", "nodes=1", "optim.lr=0.00123", "optim=adamw"]


def asked(sampler: Any, space: Space, n: int = 3) -> list[dict[str, Any]]:
    study = optuna.create_study(sampler=sampler)
    return [study.ask(space.params).params for _ in range(n)]


def test_the_templates_sampler_config_is_used_unchanged_and_seeded() -> None:
    sweeper = yaml.safe_load(TEMPLATE)["hydra"]["sweeper"]
    space = search_space([], sweeper["params"])
    first, again = (study_parts.sampler(sweeper["sampler"], space) for _ in range(2))
    assert isinstance(first, optuna.samplers.TPESampler)
    assert asked(first, space) == asked(again, space)  # seed 1234: the same draws
    assert study_parts.directions(sweeper["direction"]) == ["maximize"]


def test_short_names_and_the_plugins_seed() -> None:
    space = search_space(["a=interval(0, 1)"])
    for name, cls in (("random", "RandomSampler"), ("cmaes", "CmaEsSampler"),
                      ("optuna.samplers.TPESampler", "TPESampler")):
        assert type(study_parts.sampler(name, space, seed=3)).__name__ == cls
    assert asked(study_parts.sampler("random", space, seed=3), space) == asked(
        study_parts.sampler("random", space, seed=3), space)
    assert isinstance(study_parts.pruner("hyperband"), optuna.pruners.HyperbandPruner)
    assert isinstance(study_parts.pruner({"_target_": "optuna.pruners.MedianPruner",
                                          "n_warmup_steps": 2}), optuna.pruners.MedianPruner)
    assert isinstance(study_parts.pruner(None), optuna.pruners.NopPruner)


def test_a_grid_draws_every_choice_and_step() -> None:
    space = search_space(["a=choice(x, y)", "b=range(1, 4)"])
    sampler = study_parts.sampler("grid", space)
    seen = {tuple(p.values()) for p in asked(sampler, space, n=6)}
    assert seen == {(a, b) for a in "xy" for b in (1, 2, 3)}
    with pytest.raises(UserError, match="a continuous range, which a grid cannot enumerate"):
        study_parts.sampler("grid", search_space(["c=interval(0, 1)"]))


@pytest.mark.parametrize("call, key, said", [
    (lambda s: study_parts.sampler("annealing", s), "hydra.sweeper.sampler",
     "use one of: tpe (TPESampler)"),
    (lambda s: study_parts.sampler({"_target_": "optuna.samplers.TPESampler", "sed": 1}, s),
     "hydra.sweeper.sampler.sed", "is not an argument of TPESampler"),
    (lambda s: study_parts.pruner({"n_warmup_steps": 1}), "hydra.sweeper.pruner",
     "has no _target_"),
    (lambda s: study_parts.sampler("cmaes", s, objectives=2), "hydra.sweeper.sampler",
     "use tpe or nsgaii for several objectives"),
    (lambda s: study_parts.pruner("median", objectives=2), "hydra.sweeper.pruner",
     "cannot prune a study of several objectives"),
    (lambda s: study_parts.pruner("early"), "hydra.sweeper.pruner", "median (MedianPruner)"),
    (lambda s: study_parts.directions("maximise"), "hydra.sweeper.direction",
     "use minimize or maximize"),
])
def test_bad_study_settings_name_the_key_and_the_fix(call: Any, key: str, said: str) -> None:
    with pytest.raises(UserError) as caught:
        call(search_space(["a=interval(0, 1)"]))
    assert caught.value.message.startswith(key) and said in caught.value.message


def test_several_objectives() -> None:
    assert study_parts.directions(["minimize", "Maximize"]) == ["minimize", "maximize"]
    assert study_parts.directions(None) == ["minimize"]
