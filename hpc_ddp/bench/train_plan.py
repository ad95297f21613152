"""What the training benchmark measures, shared by its driver (train.py) and the program every
rank runs (train_rank.py): the models, the contenders, the options, the result's place."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hpc_ddp.config.schema import Config
from hpc_ddp.errors import UserError

RESULT = Path("bench") / "train.json"


# exact: the hand-written loop's settings: fp32, NCHW, torch's default optimizer
# implementation, DDP's defaults, no loader workers and no pinning (a default DataLoader),
# torch's default (non-deterministic) algorithms; on hpc_ddp's own loader, which slices a
# batch out of the in-memory tensors (the baseline has no such setting).
EXACT = ("trainer.precision=fp32", "trainer.channels_last=false", "trainer.compile=false",
         "trainer.fused_optimizer=false", "trainer.ddp_bucket_cap_mb=null",
         "trainer.ddp_gradient_as_bucket_view=false", "trainer.ddp_static_graph=false",
         "data.num_workers=0", "data.pin_memory=false", "trainer.deterministic=false")


# plain: exact on the textbook data path too (per-sample fetch + default_collate): the same
# work as the hand-written loop, step for step, so plain - baseline is the framework's cost.
PLAIN = (*EXACT, "data.batched=false")


MODELS = ("null", "tiny_cnn", "resnet18")


@dataclass(frozen=True)
class Variant:
    name: str
    overrides: tuple[str, ...]  # on top of the job's config (empty for the baseline)


@dataclass(frozen=True)
class TrainOptions:
    models: tuple[str, ...] = MODELS
    variants: tuple[Variant, ...] = ()
    # Rounds per model: as many as fit budget_s (estimated from the baseline's pace), at
    # least min_rounds and at most rounds.
    rounds: int = 15
    min_rounds: int = 3
    budget_s: float = 45.0
    # Seconds of the baseline's steps per window; each window runs that many steps.
    window_s: float = 1.0
    min_steps: int = 1
    warmup_steps: int = 2
    world_sizes: tuple[int, ...] = ()
    startup: bool = False
    # Checkpoint every this many steps in two more contenders (0: none): synchronous and
    # background writes, each against `tuned` (the step stall a checkpoint costs).
    checkpoint_every: int = 0


def for_model(model: str, variants: tuple[Variant, ...]) -> tuple[Variant, ...]:
    """The contenders besides the baseline for ``model``: the null model also gets ``plain``
    (the framework's overhead is plain - baseline on it)."""
    if model == "null" and all(v.name != "plain" for v in variants):
        return (Variant("plain", PLAIN), *variants)
    return variants


def with_overrides(cfg: Config, overrides: Sequence[str]) -> Config:
    """``cfg`` with dotted ``key=value`` overrides applied and checked (UserError if bad)."""
    # deferred: omegaconf; start-up: config.validate
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from hpc_ddp.config.validate import validate

    if not overrides:
        return cfg
    try:
        node = OmegaConf.merge(OmegaConf.structured(cfg), OmegaConf.from_dotlist(list(overrides)))
        out = OmegaConf.to_object(node)
    except OmegaConfBaseException as exc:
        raise UserError("--variant", " ".join(overrides), f"does not fit the config ({exc}).",
                        "check the key names against docs/configuration.md.") from None
    assert isinstance(out, Config)
    return validate(out)


def replace_model(cfg: Config, name: str) -> Config:
    """``cfg`` training model ``name`` (``null`` included, which the config cannot name)."""
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, name=name))
