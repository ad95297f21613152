"""Ranges and cross-field rules the types alone cannot express.

Each rule raises :class:`UserError` naming the key, the value and the fix. Rules that need the
file system (a data root, a writable run dir) live with the code that uses those paths.
"""

from __future__ import annotations

import re

from hpc_ddp.config.nccl_schema import validate_nccl
from hpc_ddp.config.schema import Config
from hpc_ddp.errors import UserError

MODELS = ("tiny_cnn", "resnet18", "resnet50")
DATASETS = ("synthetic", "cifar10")
OPTIMIZERS = ("sgd", "adamw")
SCHEDULES = ("cosine", "linear", "constant")
CLUSTER_KINDS = ("auto", "local", "slurm")
# Both data sets have 10 classes; CIFAR-10 images are 32x32.
DATA_CLASSES = 10
CIFAR_SIDE = 32
DEVICES = ("auto", "cpu", "cuda")
GPU_BINDINGS = ("per_node", "per_task")
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
# Slurm accepts signal names with or without the SIG prefix (sbatch --signal).
_SIGNAL = re.compile(r"^(SIG)?[A-Z0-9]+$")
# A job name reaches sbatch as data, but we also keep it printable and on one line.
_JOB_NAME = re.compile(r"^[A-Za-z0-9_.+-]{1,128}$")


def _choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise UserError(key, value, "unknown value.", f"use one of {', '.join(allowed)}.")


def _at_least(key: str, value: float | None, low: float, fix: str = "") -> None:
    if value is not None and value < low:
        raise UserError(key, value, f"must be >= {low:g}.", fix or f"set {key} to {low:g} or more.")


def validate(cfg: Config) -> Config:
    """Check every value; return ``cfg`` unchanged, or raise UserError on the first bad one."""
    _at_least("nodes", cfg.nodes, 1, "set nodes=1 or more.")
    _validate_cluster(cfg)
    _choice("model.name", cfg.model.name, MODELS)
    if cfg.model.num_classes != DATA_CLASSES:
        raise UserError("model.num_classes", cfg.model.num_classes,
                        f"the {cfg.data.name} data has {DATA_CLASSES} classes.",
                        f"set model.num_classes={DATA_CLASSES}.")
    _validate_data(cfg)
    _validate_optim(cfg)
    _validate_trainer(cfg)
    validate_nccl(cfg.nccl)
    return cfg


def _validate_cluster(cfg: Config) -> None:
    c = cfg.cluster
    _choice("cluster.kind", c.kind, CLUSTER_KINDS)
    _choice("cluster.gpu_binding", c.gpu_binding, GPU_BINDINGS)
    _at_least("cluster.tasks_per_node", c.tasks_per_node, 1)
    _at_least("cluster.gpus_per_node", c.gpus_per_node, 0)
    _at_least("cluster.cpus_per_task", c.cpus_per_task, 1)
    _at_least("cluster.time_min", c.time_min, 1)
    _at_least("cluster.signal_delay_s", c.signal_delay_s, 0)
    _at_least("cluster.max_restarts", c.max_restarts, 0)
    if c.mem_gb is not None and c.mem_gb <= 0:
        raise UserError("cluster.mem_gb", c.mem_gb, "must be positive.", "omit it or give GB.")
    if c.gpus_per_node > 0 and c.tasks_per_node not in (None, c.gpus_per_node):
        raise UserError(
            "cluster.tasks_per_node",
            c.tasks_per_node,
            f"differs from cluster.gpus_per_node={c.gpus_per_node}; hpc_ddp runs one task per GPU.",
            f"set cluster.tasks_per_node={c.gpus_per_node} or leave it unset (derived).",
        )
    if not _SIGNAL.match(c.signal):
        raise UserError("cluster.signal", c.signal, "not a signal name.", "use e.g. USR2.")
    if not _JOB_NAME.match(c.job_name):
        raise UserError(
            "cluster.job_name",
            c.job_name,
            "only letters, digits and _ . + - are allowed (it becomes a file and job name).",
            "choose a plain name such as my_run.",
        )


def _validate_data(cfg: Config) -> None:
    d = cfg.data
    _choice("data.name", d.name, DATASETS)
    _at_least("data.train_size", d.train_size, 1)
    _at_least("data.eval_size", d.eval_size, 1)
    _at_least("data.noise", d.noise, 0)
    _at_least("data.num_workers", d.num_workers, 0, "set 0 or more, or null (auto).")
    _at_least("data.prefetch_factor", d.prefetch_factor, 1, "set 1 or more, or null.")
    _at_least("data.image_size", d.image_size, 8)
    if d.name == "cifar10" and d.image_size != CIFAR_SIDE:
        raise UserError("data.image_size", d.image_size, "CIFAR-10 images are 32x32.",
                        "drop data.image_size (it applies to synthetic data only).")
    if d.name == "cifar10" and not d.root:
        raise UserError(
            "data.root",
            d.root,
            "cifar10 needs the folder that holds cifar-10-batches-py/.",
            "pass data.root=/path (fetch it once with "
            "`python -m hpc_ddp.data download cifar10 root=/path`).",
        )


def _validate_optim(cfg: Config) -> None:
    o = cfg.optim
    _choice("optim.name", o.name, OPTIMIZERS)
    _choice("optim.schedule", o.schedule, SCHEDULES)
    if not o.lr > 0:
        raise UserError("optim.lr", o.lr, "must be positive.", "use e.g. optim.lr=0.05.")
    _at_least("optim.weight_decay", o.weight_decay, 0)
    _at_least("optim.momentum", o.momentum, 0)
    _at_least("optim.warmup_steps", o.warmup_steps, 0)
    if not 0 <= o.min_lr_ratio <= 1:
        raise UserError("optim.min_lr_ratio", o.min_lr_ratio, "must lie in [0, 1].", "")
    if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
        raise UserError("optim.betas", o.betas, "needs two values in [0, 1).", "")


def _validate_trainer(cfg: Config) -> None:
    t = cfg.trainer
    _at_least("trainer.epochs", t.epochs, 1)
    _at_least("trainer.max_steps", t.max_steps, 1, "set a positive step count or null.")
    _at_least("trainer.batch_size", t.batch_size, 1, "give samples per rank, e.g. 64.")
    _at_least("trainer.grad_accum", t.grad_accum, 1)
    _at_least("trainer.eval_interval", t.eval_interval, 0)
    _at_least("trainer.checkpoint_interval", t.checkpoint_interval, 1)
    _at_least("trainer.log_interval", t.log_interval, 1)
    _at_least("trainer.keep_checkpoints", t.keep_checkpoints, 1)
    _at_least("trainer.seed", t.seed, 0)
    _at_least("trainer.collective_timeout_s", t.collective_timeout_s, 1)
    _at_least("trainer.rendezvous_timeout_s", t.rendezvous_timeout_s, 1)
    _at_least("trainer.threads", t.threads, 1)
    _at_least("trainer.stop_check_interval", t.stop_check_interval, 1)
    _choice("trainer.device", t.device, DEVICES)
    _choice("trainer.precision", t.precision, PRECISIONS)
    _at_least("trainer.ddp_bucket_cap_mb", t.ddp_bucket_cap_mb, 1)
    if t.ddp_static_graph and t.grad_accum > 1:
        # DDP's reducer asserts when the first backward of a static graph runs in no_sync()
        # (torch 2.14), and a run with accumulation starts (and resumes) there.
        raise UserError("trainer.ddp_static_graph", t.ddp_static_graph,
                        "does not work with gradient accumulation (no_sync).",
                        "set trainer.ddp_static_graph=false or trainer.grad_accum=1.")
