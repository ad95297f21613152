"""Ranges and cross-field rules the types alone cannot express: each raises :class:`UserError`
naming the key, the value and the fix. Rules that need the file system (a data root, a
writable run dir) live with the code that uses those paths."""

from __future__ import annotations

import dataclasses
import math
import re
import signal
from typing import Any

from hpc_ddp.config.container_schema import validate_container
from hpc_ddp.config.loggers import validate_logger
from hpc_ddp.config.nccl_schema import validate_nccl
from hpc_ddp.config.sbatch_extra import check_sbatch_extra
from hpc_ddp.config.schema import ClusterConfig, Config
from hpc_ddp.config.sharding_rules import validate_sharding
from hpc_ddp.config.sync_rules import validate_sync
from hpc_ddp.errors import UserError, shown
from hpc_ddp.rundir import parse_umask

MODELS = ("tiny_cnn", "resnet18", "resnet50")
DATASETS = ("synthetic", "cifar10", "image_folder", "shards")
DECODERS = ("auto", "pil", "simplejpeg", "cuda")
LOSSES = ("cross_entropy",)
OPTIMIZERS = ("sgd", "adamw")
SCHEDULES = ("cosine", "linear", "constant")
METRICS = ("auto", "accuracy", "none")
CLUSTER_KINDS = ("auto", "local", "slurm", "step")
# Both data sets have 10 classes; CIFAR-10 images are 32x32.
DATA_CLASSES = 10
CIFAR_SIDE = 32
DEVICES = ("auto", "cpu", "cuda")
GPU_BINDINGS = ("per_node", "per_task")
# The cluster keys that are Slurm names, passed to sbatch as --<name>=<value>.
SLURM_NAMED = ("partition", "account", "qos", "constraint", "exclude", "nodelist")
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
# The names sbatch --signal knows (with or without SIG; Slurm's sig_name2num table,
# https://github.com/SchedMD/slurm/blob/master/src/common/proc_args.c); the ranks install
# their handler by name, so numbers are refused too.
SLURM_SIGNALS = ("HUP", "INT", "QUIT", "ABRT", "KILL", "ALRM", "TERM", "USR1", "USR2", "URG",
                 "CONT", "STOP", "TSTP", "TTIN", "TTOU", "XCPU")
# Signals that cannot be the stop-and-requeue signal, and why.
_RESERVED_SIGNALS = {
    "KILL": "cannot be caught, so no checkpoint would be written",
    "STOP": "cannot be caught, so no checkpoint would be written",
    "TERM": "is what Slurm itself sends at the time limit and on scancel; the ranks take it as "
            "a final stop, without requeue",
    "INT": "is Ctrl-C: a terminal's interrupt would pass for the time-limit signal",
    "CONT": "is job control (Slurm resumes a suspended job with it)",
    "TSTP": "is job control (Slurm suspends a job with it)",
}
# sbatch --signal's time is a 16-bit count of seconds (65535 is Slurm's "infinite");
# https://slurm.schedmd.com/sbatch.html#OPT_signal
SIGNAL_DELAY_LIMIT = 65535
# Ceilings no real request reaches, so a typo (1e308, an extra zero run wild) is refused here
# in one line, not as an overflow deep in the launch or a request sbatch cannot parse; what a
# partition really has is checked against sinfo at submission (slurm/fit.py).
MAX_MEM_GB = 1 << 20  # 1 PiB per node
MAX_TIME_MIN = 366 * 24 * 60  # a year: Slurm's limits are in minutes
# A job name reaches sbatch as data, but we also keep it printable and on one line.
_JOB_NAME = re.compile(r"^[A-Za-z0-9_.+-]{1,128}$")
# Linux interface names: IFNAMSIZ - 1 characters, no "/" or whitespace (net/core/dev.c).
_INTERFACE = re.compile(r"^[^/\s:]{1,15}$")


def _choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise UserError(key, value, "unknown value.", f"use one of {', '.join(allowed)}.")


def _at_least(key: str, value: float | None, low: float, fix: str = "") -> None:
    if value is not None and value < low:
        raise UserError(key, value, f"must be >= {low:g}.", fix or f"set {key} to {low:g} or more.")


def _at_most(key: str, value: float | None, high: int, what: str) -> None:
    if value is not None and value > high:
        raise UserError(key, value, f"is more than {what} ({high}).",
                        f"set {key} to what the job needs, at most {high}.")


def validate(cfg: Config) -> Config:
    """Check every value; return ``cfg`` unchanged, or raise UserError on the first bad one."""
    _finite(cfg, Config(), "")
    _at_least("nodes", cfg.nodes, 1, "set nodes=1 or more.")
    _validate_cluster(cfg)
    _validate_parts(cfg)
    _validate_data(cfg)
    _validate_optim(cfg)
    _validate_trainer(cfg)
    validate_sharding(cfg)
    validate_entry(cfg)
    validate_nccl(cfg.nccl)
    validate_container(cfg.cluster)
    validate_logger(cfg.logger)
    return cfg


def _validate_parts(cfg: Config) -> None:
    """Built-in parts name one of ours; `_target_` parts are checked where they are built
    (launch/targets.py on the submit host, the ranks again)."""
    for part, allowed in (("model", MODELS), ("data", DATASETS), ("loss", LOSSES),
                          ("optim", OPTIMIZERS), ("scheduler", SCHEDULES),
                          ("metrics", METRICS)):
        node = getattr(cfg, part)
        if node.target is None:
            if node.name is None:
                raise UserError(f"{part}.name", "null", f"a built-in {part} needs a name.",
                                f"use one of {', '.join(allowed)}, or give {part}._target_.")
            _choice(f"{part}.name", node.name, allowed)
    classes = cfg.model.num_classes
    if cfg.model.target is None and classes is not None and cfg.data.target is None and (
            cfg.data.name in ("synthetic", "cifar10") and classes != DATA_CLASSES):
        raise UserError("model.num_classes", classes,
                        f"the {cfg.data.name} data has {DATA_CLASSES} classes.",
                        f"set model.num_classes={DATA_CLASSES} (or null: the data's).")
    _at_least("model.num_classes", classes, 1, "give the classes to predict, or null.")
    s = cfg.scheduler
    _at_least("scheduler.warmup_steps", s.warmup_steps, 0)
    if not 0 <= s.min_lr_ratio <= 1:
        raise UserError("scheduler.min_lr_ratio", s.min_lr_ratio, "must lie in [0, 1].",
                        "use a fraction of optim.lr, e.g. scheduler.min_lr_ratio=0.1.")
    _at_least("loss.label_smoothing", cfg.loss.label_smoothing, 0)


# An entry function: "pkg.module:function" (the form of Python's entry points).
_ENTRY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def validate_entry(cfg: Config) -> Config:
    """entry/script: at most one, well formed (whether they import is checked at launch)."""
    if cfg.entry is not None and cfg.script is not None:
        raise UserError("script", cfg.script, f"and entry={cfg.entry} are both set; a run has "
                        "one program.", "keep one: entry=pkg.module:function or script=train.py.")
    if cfg.entry is not None and not _ENTRY.match(cfg.entry):
        raise UserError("entry", cfg.entry, "is not module:function.",
                        "write the import path, a colon, and the function: "
                        "entry=my_pkg.train:main.")
    if cfg.script is not None:
        module = cfg.script.removeprefix("-m").strip() if cfg.script.startswith("-m") else None
        if not cfg.script.strip() or module == "" or (
                module is not None and not re.match(r"^[A-Za-z_][\w.]*$", module)):
            raise UserError("script", cfg.script, "is neither a script path nor -m <module>.",
                            "write script=train.py, or 'script=-m my_pkg.train' (quoted: it "
                            "holds a space).")
        if cfg.cluster.gpus_per_node and cfg.cluster.gpu_binding == "per_task":
            raise UserError("cluster.gpu_binding", "per_task", "gives each task one GPU as "
                            "device 0, but a torchrun-style script uses cuda:LOCAL_RANK.",
                            "use cluster.gpu_binding=per_node (the default) with a script.")
    if cfg.script_args and cfg.script is None:
        raise UserError("script_args", cfg.script_args, "are arguments for a script, and no "
                        "script is set.", "add script=<path>, or drop the arguments after --.")
    return cfg


def _finite(node: Any, default: Any, prefix: str) -> None:
    """Hydra reads inf and nan as floats; no key of ours means either (and int(inf) would
    fail deep inside the launch)."""
    for f in dataclasses.fields(node):
        value, example = getattr(node, f.name), getattr(default, f.name)
        if dataclasses.is_dataclass(value):
            _finite(value, example, f"{prefix}{f.name}.")
            continue
        values = value if isinstance(value, list) else [value]
        if any(isinstance(v, float) and not math.isfinite(v) for v in values):
            key = f"{prefix}{f.name}"
            fix = (f"give a number, or {key}=null." if example is None
                   else f"give a number, e.g. {key}={example}.")
            raise UserError(key, value, "is not a finite number.", fix)


def _validate_cluster(cfg: Config) -> None:
    c = cfg.cluster
    _choice("cluster.kind", c.kind, CLUSTER_KINDS)
    _choice("cluster.gpu_binding", c.gpu_binding, GPU_BINDINGS)
    _at_least("cluster.tasks_per_node", c.tasks_per_node, 1)
    _at_least("cluster.gpus_per_node", c.gpus_per_node, 0)
    _at_least("cluster.cpus_per_task", c.cpus_per_task, 1)
    _at_least("cluster.time_min", c.time_min, 1)
    _at_most("cluster.time_min", c.time_min, MAX_TIME_MIN, "a year of minutes")
    _at_most("cluster.mem_gb", c.mem_gb, MAX_MEM_GB, "any node has")
    _at_least("cluster.signal_delay_s", c.signal_delay_s, 0)
    _at_least("cluster.max_restarts", c.max_restarts, 0)
    _at_least("cluster.restarts_in_place", c.restarts_in_place, 0)
    _at_least("cluster.spare_nodes", c.spare_nodes, 0)
    _at_least("cluster.warm_keep_s", c.warm_keep_s, 0, "set cluster.warm_keep_s to 0 (the "
              "warm process leaves with its run) or to the seconds it may wait for the next.")
    if c.spare_nodes and c.container.kind != "none":
        raise UserError("cluster.spare_nodes", c.spare_nodes, "needs hpc_ddp's driver in the "
                        "batch script, which runs outside the container (not yet supported).",
                        "set cluster.spare_nodes=0 with a container.")
    if c.min_nodes is not None:
        _check_min_nodes(cfg)
    if c.mem_gb is not None and c.mem_gb * 1024 < 1:
        # Below 1 MB the request would round to --mem=0M, which Slurm reads as "all of the
        # node's memory" (https://slurm.schedmd.com/sbatch.html#OPT_mem).
        raise UserError("cluster.mem_gb", c.mem_gb, "must be positive (at least 1 MB).",
                        "give GB per node, e.g. cluster.mem_gb=32, or null for the default.")
    for name in SLURM_NAMED:
        if getattr(c, name) == "":
            raise UserError(f"cluster.{name}", "", "is empty.",
                            f"give a value, or cluster.{name}=null for Slurm's default.")
    if (c.gpus_per_node or 0) > 0 and c.tasks_per_node not in (None, c.gpus_per_node):
        raise UserError(
            "cluster.tasks_per_node",
            c.tasks_per_node,
            f"differs from cluster.gpus_per_node={c.gpus_per_node}; hpc_ddp runs one task per GPU.",
            f"set cluster.tasks_per_node={c.gpus_per_node} or leave it unset (derived).",
        )
    _validate_signal(c)
    check_sbatch_extra(c)
    if c.master_interface is not None and not _INTERFACE.match(c.master_interface):
        raise UserError("cluster.master_interface", c.master_interface,
                        "is not an interface name (at most 15 characters, no spaces or /).",
                        "give the name `ip -br addr` shows on a node, e.g. ib0, or null.")
    try:
        parse_umask(c.umask)
    except ValueError:
        raise UserError("cluster.umask", c.umask, "is not an octal umask that keeps the run "
                        "dir writable by you alone (group and others must not write: a file "
                        "planted there would run on the next restart).",
                        "use 027 (your group may read: the default), 077 (only you) or 022 "
                        "(everyone may read).") from None
    if not _JOB_NAME.match(c.job_name):
        raise UserError(
            "cluster.job_name",
            c.job_name,
            "only letters, digits and _ . + - are allowed (it becomes a file and job name).",
            "choose a plain name such as my_run.",
        )


def _check_min_nodes(cfg: Config) -> None:
    """cluster.min_nodes: between 1 and nodes, on a run hpc_ddp's node-loss driver runs."""
    c = cfg.cluster
    if not 1 <= (c.min_nodes or 0) <= cfg.nodes:
        raise UserError("cluster.min_nodes", c.min_nodes, f"must be between 1 and nodes "
                        f"({cfg.nodes}).", f"e.g. cluster.min_nodes={max(cfg.nodes - 1, 1)}, "
                        "or null to requeue on a lost node.")
    if c.container.kind != "none" or c.supervise is False or c.restarts_in_place == 0:
        raise UserError("cluster.min_nodes", c.min_nodes, "needs hpc_ddp's driver in the batch "
                        "script: supervised ranks (cluster.supervise), restarts in place "
                        "(cluster.restarts_in_place > 0), no container.",
                        "drop cluster.min_nodes, or use those settings.")


def _validate_signal(c: ClusterConfig) -> None:
    bare = c.signal.removeprefix("SIG")
    usable = [s for s in SLURM_SIGNALS if s not in _RESERVED_SIGNALS]
    choices = f"use USR2 (the default) or one of {', '.join(s for s in usable if s != 'USR2')}."
    if bare.isdigit():
        try:
            named = signal.Signals(int(bare)).name.removeprefix("SIG")
        except ValueError:
            named = ""
        raise UserError("cluster.signal", c.signal, "is a number; the ranks need a name.",
                        f"use cluster.signal={named}." if named in usable else choices)
    if bare.upper() in SLURM_SIGNALS and bare != bare.upper():
        raise UserError("cluster.signal", c.signal, "signal names are upper case.",
                        f"use cluster.signal={bare.upper()}.")
    if bare not in SLURM_SIGNALS:
        known = f"SIG{bare}" in signal.Signals.__members__
        raise UserError("cluster.signal", c.signal, "is not a signal sbatch --signal takes by "
                        "name." if known else "is not a signal name.", choices)
    if bare in _RESERVED_SIGNALS:
        raise UserError("cluster.signal", c.signal,
                        f"{_RESERVED_SIGNALS[bare]}.", choices)
    if c.signal_delay_s >= SIGNAL_DELAY_LIMIT:
        raise UserError("cluster.signal_delay_s", c.signal_delay_s,
                        f"must be below {SIGNAL_DELAY_LIMIT} (sbatch --signal's limit).",
                        "use seconds before the time limit, e.g. cluster.signal_delay_s=120.")
    limit = c.time_min * 60
    if c.signal_delay_s >= limit:
        raise UserError("cluster.signal_delay_s", c.signal_delay_s,
                        f"is not below the time limit (cluster.time_min={c.time_min} min = "
                        f"{limit} s): the stop signal would come as the job starts.",
                        f"use fewer than {limit} seconds, e.g. cluster.signal_delay_s="
                        f"{min(120, limit // 4)}, or raise cluster.time_min.")


def _validate_data(cfg: Config) -> None:
    d = cfg.data
    _at_least("data.train_size", d.train_size, 1)
    _at_least("data.eval_size", d.eval_size, 1)
    _at_least("data.noise", d.noise, 0)
    _at_least("data.num_workers", d.num_workers, 0, "set 0 or more, or null (auto).")
    _at_least("data.prefetch_factor", d.prefetch_factor, 1, "set 1 or more, or null.")
    _at_least("data.image_size", d.image_size, 8)
    if d.name == "cifar10" and d.image_size != CIFAR_SIDE:
        raise UserError("data.image_size", d.image_size, "CIFAR-10 images are 32x32.",
                        "drop data.image_size (it applies to synthetic data only).")
    if d.name == "image_folder" and not d.root:
        raise UserError("data.root", shown(d.root), "image_folder needs the folder that holds "
                        f"{d.train_split}/ and {d.eval_split}/ (one folder per class in each).",
                        "pass data.root=/path/to/imagenet-style/folder.")
    if d.name == "shards" and not d.root:
        raise UserError("data.root", shown(d.root), "shards needs the folder that "
                        "`python -m hpc_ddp.data pack` wrote.",
                        "pass data.root=/path/to/shards (pack an image folder first: python -m "
                        "hpc_ddp.data pack SRC DST).")
    _validate_loading(cfg)
    if d.name == "cifar10" and not d.root:
        raise UserError(
            "data.root",
            shown(d.root),
            "cifar10 needs the folder that holds cifar-10-batches-py/.",
            "pass data.root=/path (fetch it once with "
            "`python -m hpc_ddp.data download cifar10 root=/path`).",
        )


def _validate_loading(cfg: Config) -> None:
    """Staging and the image decoders (docs/data.md)."""
    d = cfg.data
    _at_least("data.shuffle_buffer", d.shuffle_buffer, 1, "set 1 (no shuffle within a rank's "
              "stream) or more, e.g. 8192.")
    if d.decoder not in DECODERS:
        raise UserError("data.decoder", d.decoder, "is not a decoder.",
                        f"use one of {', '.join(DECODERS)}.")
    if d.decoder == "cuda" and d.target is None and d.name != "shards":
        raise UserError("data.decoder", d.decoder, f"decodes shards on the GPU, not {d.name}.",
                        "use data=shards (python -m hpc_ddp.data pack), or data.decoder=auto.")
    own_loop = cfg.entry is not None or cfg.script is not None  # reads data.root itself
    if d.stage and d.target is None and d.name == "synthetic" and not own_loop:
        raise UserError("data.stage", True, "synthetic data is made in memory: there is "
                        "nothing to copy.", "drop data.stage, or stage a data set on disk.")
    if d.stage and d.target is None and own_loop and not d.root:
        raise UserError("data.root", "null", "data.stage=true copies data.root to each node "
                        "for your program, but none is set.", "set data.root=/shared/path, or "
                        "drop data.stage.")
    if d.stage and d.target is not None and not d.kwargs.get("root"):
        raise UserError("data.root", "null", "data.stage=true copies your factory's root "
                        "argument to each node and passes it the copy, but none is set.",
                        "set data.root=/shared/path (your factory takes root=), or "
                        "data.stage=false.")
    if d.stage_dir is not None and not str(d.stage_dir).strip():
        raise UserError("data.stage_dir", d.stage_dir, "is empty.",
                        "give a node-local folder, or null ($SLURM_TMPDIR, $TMPDIR, /tmp).")


def _validate_optim(cfg: Config) -> None:
    o = cfg.optim
    if o.target is not None:
        return  # its arguments are the callable's (checked where it is built)
    if not o.lr > 0:
        raise UserError("optim.lr", o.lr, "must be positive.", "use e.g. optim.lr=0.05.")
    _at_least("optim.weight_decay", o.weight_decay, 0)
    _at_least("optim.momentum", o.momentum, 0)
    if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
        raise UserError("optim.betas", o.betas, "needs two values in [0, 1).",
                        "use e.g. 'optim.betas=[0.9,0.999]'.")


def _validate_trainer(cfg: Config) -> None:
    t = cfg.trainer
    _at_least("trainer.epochs", t.epochs, 1)
    _at_least("trainer.max_steps", t.max_steps, 1, "set a positive step count or null.")
    _at_least("trainer.batch_size", t.batch_size, 1, "give samples per rank, e.g. 64.")
    _at_least("trainer.grad_accum", t.grad_accum, 1)
    _at_least("trainer.eval_interval", t.eval_interval, 0)
    _at_least("trainer.seed", t.seed, 0)
    for key in ("checkpoint_interval", "log_interval", "keep_checkpoints", "collective_timeout_s",
                "rendezvous_timeout_s", "threads", "stop_check_interval"):
        _at_least(f"trainer.{key}", getattr(t, key), 1)
    _at_least("trainer.hang_timeout_s", t.hang_timeout_s, 1, "give seconds (e.g. 600) or null.")
    _choice("trainer.device", t.device, DEVICES)
    _choice("trainer.precision", t.precision, PRECISIONS)
    validate_sync(cfg)  # DDP's sync settings and its communication hook
