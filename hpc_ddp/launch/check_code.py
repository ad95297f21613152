"""Before anything is submitted: does the user's code named in the config work here?

An entry function must import and take the context; a script must exist (a module must be
importable); every `_target_` part is built as the ranks will build it (the model on the meta
device, so no memory is spent on it; the data sets for real, once per distinct data config
in a sweep), its class count checked against the data's. Each failure is one UserError
(exit 2) naming the key, the value and the fix; nothing is written. ``check_targets=false``
skips the building (the ranks then report what fails, naming their node).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hpc_ddp.config.schema import Config
from hpc_ddp.errors import UserError

# Data classes of the `_target_` data configs checked in this process (by their config).
_FACTORY_CLASSES: dict[str, int | None] = {}


def check_code(cfg: Config, cwd: Path) -> None:
    """Raise UserError for code of the user's that cannot run as configured. ``cwd`` is on
    the import path meanwhile, as it is on every rank (``python -m`` from the submit folder)."""

    added = str(cwd) not in sys.path and str(cwd.absolute()) not in sys.path
    if added:
        sys.path.insert(0, str(cwd))
    try:
        _check(cfg)
    finally:
        if added:
            sys.path.remove(str(cwd))


def _check(cfg: Config) -> None:
    if cfg.entry is not None:
        from hpc_ddp.rank.main.entry import resolve  # deferred: hostlist

        resolve(cfg.entry)
        return  # the entry builds what it needs itself
    if cfg.script is not None:
        check_script(cfg.script)
        return
    if cfg.check_targets:
        check_parts(cfg)


def check_script(script: str) -> None:
    """The script file exists, or the module is importable."""
    if script.startswith("-m"):
        from hpc_ddp.targets import has_module  # deferred (start-up): targets

        module = script[2:].strip()
        if not has_module(module):
            raise UserError("script", script, f"module {module} cannot be found.",
                            "check the name; the module must be importable where the job "
                            "runs (run from your project folder, or pip install -e it).")
        return
    path = Path(script)
    if not path.is_file():
        raise UserError("script", script, "is not a file." if path.exists() else
                        "does not exist.", "give the path of your training script (relative "
                        "to where you run this, or absolute), or 'script=-m pkg.module'.")


def check_parts(cfg: Config) -> None:
    """Build the `_target_` parts as a rank would, and check the classes agree."""
    from hpc_ddp.trainer.models import check_classes  # deferred (start-up): trainer.models

    classes = _data_classes(cfg)
    check_classes(cfg, classes)
    if any(getattr(cfg, p).target is not None for p in ("model", "optim", "scheduler")):
        _model_and_optimizer(cfg, classes)
    if cfg.loss.target is not None or cfg.metrics.target is not None:
        # deferred (start-up): trainer.objectives
        from hpc_ddp.trainer.objectives import build_loss, build_metrics

        build_loss(cfg.loss)
        build_metrics(cfg.metrics)


def _data_classes(cfg: Config) -> int | None:
    """The data's class count; a `_target_` factory is called (once per distinct config)."""
    d = cfg.data
    if d.target is not None:
        key = json.dumps({"target": d.target, "kwargs": d.kwargs, "seed": cfg.trainer.seed},
                         sort_keys=True, default=str)
        if key not in _FACTORY_CLASSES:  # a sweep's points mostly share their data
            from hpc_ddp.data.sets import build_datasets  # deferred (start-up): data.sets

            _FACTORY_CLASSES[key] = build_datasets(d, cfg.trainer.seed).num_classes
        return _FACTORY_CLASSES[key]
    if d.name == "image_folder" and d.root:
        from hpc_ddp.data import image_folder  # deferred (start-up): data.image_folder

        if Path(d.root).expanduser().is_file():  # a tar: its classes are known once extracted
            from hpc_ddp.data.staging import source_of  # deferred: concurrent, tarfile

            source_of(d.root)
            if not d.stage:
                raise UserError("data.root", d.root, "is a tar: image_folder reads a folder.",
                                "add data.stage=true (each node extracts it to local disk), "
                                "or extract it once and point data.root at the folder.")
            return None
        return len(image_folder.check_root(d.root, (d.train_split, d.eval_split))[d.train_split])
    if d.name == "shards" and d.root:
        # deferred (start-up): data.shard_index
        from hpc_ddp.data.shard_index import read_index, split_of

        index = read_index(d.root)  # before launch: a folder pack never wrote fails here
        for split in (d.train_split, d.eval_split):
            split_of(index, d.root, split)
        return len(index.get("classes", [])) or None
    return 10  # synthetic and cifar10


def _model_and_optimizer(cfg: Config, classes: int | None) -> None:
    """The model on the meta device (no memory), then the optimizer and the scheduler over
    its parameters."""
    import torch  # deferred: torch; start-up: targets, trainer.models, trainer.optim

    from hpc_ddp.targets import TargetError
    from hpc_ddp.trainer.models import build_model
    from hpc_ddp.trainer.optim import build_optimizer, build_scheduler

    try:
        with torch.device("meta"):
            model = build_model(cfg.model, cfg.data.image_size, classes)
    except TargetError as exc:
        if "meta" not in str(exc):
            raise
        return  # a model that cannot be built on the meta device: the ranks build it
    if cfg.optim.target is None and cfg.scheduler.target is None:
        return
    params = [torch.nn.Parameter(torch.empty_like(p, device="cpu"))
              for p in list(model.parameters())[:1]] or [torch.nn.Parameter(torch.zeros(1))]
    optimizer = build_optimizer(params, cfg.optim, False, "cpu")
    build_scheduler(optimizer, cfg.scheduler, 1)
