"""Before a resume goes out: will the run's checkpoint load under the new config?

A changed model (or an image size the model is built for) or optimizer would fail on every
rank at load time, after the job waited in the queue, and each requeue the same way. It is
refused here instead, with the keys that changed, and nothing of the run is rewritten.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import IO, Any

from hpc_ddp.config.schema import Config
from hpc_ddp.errors import UserError
from hpc_ddp.owned import Untrusted, open_owned
from hpc_ddp.rank.services import checkpoint, trusted
from hpc_ddp.rundir import RunDir


def check_resumable(cfg: Config, run: RunDir) -> None:
    """Raise UserError when ``cfg`` cannot continue the checkpoint in ``run``. What is read
    of the run (its config, its latest checkpoint) is read only once it passed the checks of
    hpc_ddp/owned.py, from the file that was checked, and the checkpoint as data only."""
    if not cfg.resume:
        return
    latest = checkpoint.latest_path(run.checkpoints)
    if latest is None:
        return
    if checkpoint.is_sharded(latest):
        _check_against(cfg, run, latest, None, _sharded_state(latest, run))
        return
    try:  # refused here, not on every rank after the job waited in the queue
        opened: IO[bytes] | None = open_owned(latest, run.root)
    except Untrusted as exc:
        raise UserError("run_dir", str(run.root), str(exc), "") from None
    except FileNotFoundError:
        # A dangling pointer: the resume falls back to the one before
        # (rank/services/checkpoint.py).
        opened = None
    with opened or contextlib.nullcontext():
        _check_against(cfg, run, latest, opened)


def _check_against(cfg: Config, run: RunDir, latest: Path, opened: IO[bytes] | None,
                   state: Any = None) -> None:
    """``state``: a sharded checkpoint's plain part (else read from ``opened``)."""
    if opened is not None:
        state = _load_checked(opened, latest, run)
    before = saved_config(run)
    if before is None or cfg.entry is not None or cfg.script is not None:
        return  # unreadable (the load itself will tell), or the user's own program's state
    shapes = _shapes(before), _shapes(cfg)
    if None not in shapes and shapes[0] != shapes[1]:
        changed = _changed(before, cfg, ("model", "data.image_size"))
        raise UserError(changed[0][0] if changed else "model", changed[0][2] if changed else
                        cfg.model.name, "changes the network, so the run's checkpoint cannot "
                        "be loaded (it holds " + ", ".join(f"{k}={old}" for k, old, _ in changed)
                        + ").", "drop that override to continue the run, or start a new "
                        "run_dir (resume=false) for the new network.")
    step = _step_of(latest)
    if cfg.trainer.max_steps is not None and step is not None and step >= cfg.trainer.max_steps:
        raise UserError("trainer.max_steps", cfg.trainer.max_steps, f"the run is at step {step} "
                        "already, so nothing would be trained.",
                        f"give trainer.max_steps above {step} to train further.")
    epochs = _epochs_done(state) if cfg.trainer.max_steps is None else None
    if epochs is not None and epochs >= cfg.trainer.epochs:
        # The same outcome as a max_steps the run has reached: a job that would only queue,
        # start, load and write the summary again (its checkpoint holds the final eval).
        raise UserError("trainer.epochs", cfg.trainer.epochs, f"the run has completed {epochs} "
                        f"epoch(s) already (step {step}), so nothing would be trained.",
                        f"give trainer.epochs above {epochs} (or trainer.max_steps above "
                        f"{step}) to train further.")
    old, new = _optimizer(before), _optimizer(cfg)
    if old != new:
        raise UserError("optim", new, f"differs from the checkpoint's optimizer ({old}), "
                        "whose state cannot be loaded into it.",
                        f"keep the optimizer ({old}) to continue the run, or start a new "
                        "run_dir.")


def saved_config(run: RunDir) -> Config | None:
    """The run's config.yaml, read once it passed the ownership checks (its `_target_`
    parts are imported when the network is built); None when it is missing or unreadable."""
    # deferred (start-up): config.compose, inputs.run_dir
    from hpc_ddp.config.compose import from_yaml
    from hpc_ddp.inputs.run_dir import read_saved

    text = read_saved(run.root, run.config.name, str(run.root))
    if text is None:
        return None
    try:
        return from_yaml(text)
    except UserError:
        return None


def _optimizer(cfg: Config) -> str:
    return cfg.optim.name or f"_target_={cfg.optim.target}"


def _load_checked(opened: IO[bytes] | None, path: Path, run: RunDir) -> Any:
    """The latest checkpoint as data (weights_only), from the file that was checked, mapped
    rather than read whole; None when it cannot be read (the ranks' load names why). One that
    holds more than data is refused here, before anything is submitted, its payload unrun."""
    if opened is None:
        return None
    try:
        return trusted.load_opened(opened, path, "cpu", mmap=True)
    except trusted.UntrustedCheckpoint as exc:
        raise UserError("run_dir", str(run.root), str(exc), "") from None
    except Exception:  # a truncated or foreign file: the ranks fall back to the one before
        return None


def _sharded_state(path: Path, run: RunDir) -> Any:
    """A sharded checkpoint's values that are not tensors, every file of it checked and its
    index read restricted (rank/services/dcp_read.py); None when it cannot be read."""
    from hpc_ddp.rank.services import dcp_read  # deferred: torch (dcp_read)

    try:
        return dcp_read.check(path, run.root)
    except Untrusted as exc:
        raise UserError("run_dir", str(run.root), str(exc), "") from None
    except FileNotFoundError:  # a dangling pointer: the ranks fall back to the one before
        return None
    except Exception:  # damaged: the ranks fall back to the one before
        return None


def _epochs_done(state: Any) -> int | None:
    """Full epochs the checkpoint's run completed (its counters); None when it cannot say."""
    try:
        epoch = state["counters"]["epoch"]
    except (KeyError, TypeError, IndexError):
        return None
    return epoch if isinstance(epoch, int) else None


def _step_of(path: Path | None) -> int | None:
    """The step in a checkpoint's name (step_000000120.pt, step_000000120.dcp)."""
    return checkpoint.step_of(path) if path is not None else None


def _shapes(cfg: Config) -> dict[str, tuple[int, ...]] | None:
    """Parameter and buffer shapes of cfg's network, built on the meta device (no memory);
    None when it cannot be built there (a `_target_` model that needs real tensors)."""
    # deferred: torch; start-up: trainer.models
    import torch

    from hpc_ddp.trainer.models import build_model

    classes = cfg.model.num_classes if cfg.model.target is None else None
    try:
        with torch.device("meta"):
            model = build_model(cfg.model, cfg.data.image_size, classes)
    except Exception:  # the load itself will say what does not fit
        return None
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _changed(before: Config, after: Config, keys: tuple[str, ...]) -> list[tuple[str, Any, Any]]:
    """(dotted key, old value, new value) of every leaf under ``keys`` that differs."""
    found = []
    for key in keys:
        old, new = _get(before, key), _get(after, key)
        if dataclasses.is_dataclass(old) and dataclasses.is_dataclass(new):
            found += [(f"{key}.{f.name}", getattr(old, f.name), getattr(new, f.name))
                      for f in dataclasses.fields(old) if getattr(old, f.name) !=
                      getattr(new, f.name)]
        elif old != new:
            found.append((key, old, new))
    return found


def _get(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg
