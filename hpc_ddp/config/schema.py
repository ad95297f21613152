"""Typed schemas for every config group.

The YAML files under ``conf/`` hold the values; these dataclasses hold the types. Hydra merges
each YAML into the matching typed node, so an unknown key or a value of the wrong type is
refused while the config is composed, before anything starts. Ranges and cross-field rules
(``validate.py``) are checked right after.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass, field
from typing import Any

from hpc_ddp.config.cluster_schema import ClusterConfig
from hpc_ddp.config.container_schema import ContainerConfig
from hpc_ddp.config.nccl_schema import NcclConfig

# A "part" (model, data, loss, optim, scheduler, metrics) is either one of hpc_ddp's own,
# chosen by `name` with the typed keys below, or built by a `_target_` (Hydra's convention,
# https://hydra.cc/docs/advanced/instantiate_objects/overview/): the YAML node then holds
# `_target_` and the callable's keyword arguments; here they are `target` and `kwargs`
# (config/parts.py converts between the two shapes). docs/your-code.md has examples.


@dataclass
class ModelConfig:
    # tiny_cnn | resnet18 | resnet50; None when a `_target_` builds the model
    # (conf/model/torchvision.yaml and timm.yaml are such targets, and so is your own).
    name: str | None = "tiny_cnn"
    # Classes the network predicts; None: the data's (checked against the data's when both say).
    num_classes: int | None = None
    # `_target_`: import path of a callable returning an nn.Module; `kwargs`: its arguments.
    target: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class DataConfig:
    # synthetic | cifar10 | image_folder | shards; None when a `_target_` builds the data sets.
    name: str | None = "synthetic"
    # cifar10: the folder holding cifar-10-batches-py/. image_folder: the folder holding the
    # train and eval splits, each one folder per class (ImageNet's layout), or a tar of it
    # (with stage=true). shards: what `python -m hpc_ddp.data pack` wrote. Ranks never
    # download.
    root: str | None = None
    # image_folder and shards: the split folders under root.
    train_split: str = "train"
    eval_split: str = "val"
    # Check CIFAR-10's files against torchvision's MD5 sums when loading (cifar10 only).
    verify_checksum: bool = True
    # Image side in pixels: synthetic images are made at this size, image_folder and shards
    # crop to it; cifar10 is always 32. Up to 64 the built-in ResNets get a 3x3 stride-1 stem
    # and no max-pool (the usual CIFAR adaptation); larger images keep the ImageNet stem.
    image_size: int = 32
    # Synthetic set sizes (cifar10 has its fixed 50000/10000).
    train_size: int = 4096
    eval_size: int = 1024
    # Noise level of the synthetic images (higher: harder).
    noise: float = 2.5
    # Training augmentation. synthetic/cifar10: random crop (pad 4) and horizontal flip per
    # batch, drawn from a checkpointed generator (a resumed run sees the same ones);
    # image_folder and shards: random resized crop and flip per image (the usual ImageNet
    # recipe), drawn per sample from the seed, epoch and position (exact on resume).
    augment: bool = False
    # DataLoader worker processes per rank. None (auto): 0 on CPU, where a batch is one slice
    # of in-memory tensors and a worker only competes with the model for the task's cores
    # (one cost 22% of a tiny-CNN step, docs/performance.md); on CUDA
    # min(cluster.cpus_per_task - 1, 4), so batches are sliced and pinned while the GPU
    # computes. Workers never change the sample order.
    num_workers: int | None = None
    # Fetch a batch as one slice of the in-memory tensors (index_select), instead of sample by
    # sample plus default_collate as a plain DataLoader does (false: the textbook path, kept to
    # measure against; the batches are the same).
    batched: bool = True
    # Page-locked host batches, so copies to the GPU run asynchronously. None (auto): on CUDA.
    pin_memory: bool | None = None
    # Keep the worker processes between epochs (only with num_workers > 0).
    persistent_workers: bool = True
    # Batches each worker prepares ahead (only with num_workers > 0). None: torch's default, 2.
    prefetch_factor: int | None = None
    # Copy the data set (data.root: a folder, a tar, shards; a `_target_` factory's root
    # argument) to node-local disk before training, once per node; every rank then reads the
    # copy, and a requeue on the same node reuses it (docs/data.md).
    stage: bool = False
    # Where each node keeps its copy. None (auto): $SLURM_TMPDIR, else $TMPDIR, else /tmp.
    stage_dir: str | None = None
    # JPEG decoding (image_folder, shards): auto (simplejpeg where installed, else Pillow:
    # the faster, measured in docs/performance.md) | pil | simplejpeg | cuda (nvJPEG on the
    # rank's GPU; shards only).
    decoder: str = "auto"
    # shards: the samples of a rank's stream shuffled together (within the shards' shuffle).
    shuffle_buffer: int = 8192
    # `_target_`: a callable returning (train, eval) data sets, a dict with "train" and "eval",
    # or one with `.train`/`.eval`; `kwargs`: its arguments. The loader keys above stay ours.
    target: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class LossConfig:
    # cross_entropy, or None when a `_target_` builds the criterion: a module class
    # (torch.nn.MSELoss) or a function (`_partial_: true`), called as loss(outputs, targets).
    name: str | None = "cross_entropy"
    # cross_entropy's label smoothing (torch.nn.functional.cross_entropy).
    label_smoothing: float = 0.0
    target: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class OptimConfig:
    # sgd | adamw; None when a `_target_` builds the optimizer (called with the model's
    # parameters: torch.optim.RMSprop, or your own with `_partial_: true`).
    name: str | None = "sgd"
    lr: float = 0.05
    momentum: float = 0.9
    nesterov: bool = True
    weight_decay: float = 5e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    target: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class SchedulerConfig:
    # LR schedule over the optimizer steps, after a linear warm-up: cosine | linear | constant;
    # None when a `_target_` builds it (called with the optimizer, stepped once per optimizer
    # step, e.g. torch.optim.lr_scheduler.StepLR with step_size in steps).
    name: str | None = "cosine"
    warmup_steps: int = 5
    # Final LR as a fraction of the optimizer's lr (cosine and linear).
    min_lr_ratio: float = 0.0
    target: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class MetricsConfig:
    # What evaluation reports besides the loss. auto: accuracy where the outputs are class
    # scores [N, C] and the targets class indices [N], else nothing; accuracy; none. Or a
    # `_target_`: a callable(outputs, targets) -> {name: value} of batch means, which the
    # trainer weights by batch size, sums over batches and ranks, and logs as eval/<name>.
    name: str | None = "auto"
    target: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class TrainerConfig:
    epochs: int = 2
    # Stop after this many optimizer steps (None: run all epochs).
    max_steps: int | None = None
    # Samples per rank per micro-batch; the global batch is batch_size * world_size * grad_accum.
    batch_size: int = 64
    grad_accum: int = 1
    # Intervals in optimizer steps. eval_interval 0: evaluate at the end of every epoch.
    eval_interval: int = 0
    checkpoint_interval: int = 20
    log_interval: int = 10
    # Checkpoints kept in checkpoints/ (the newest ones).
    keep_checkpoints: int = 3
    # Write checkpoints in a background thread of each rank: the step only waits for the copy
    # to the CPU, and `latest` moves once every rank's part is on disk (docs/fault-tolerance.md).
    # false: write before the next step (what `bench train` measures against).
    checkpoint_background: bool = True
    # How a checkpoint is written (docs/fault-tolerance.md#sharded-checkpoints-dcp). full: one
    # torch.save file from rank 0 (a sharded model is gathered there first); dcp:
    # torch.distributed.checkpoint, every rank its own part in parallel, read back by any world
    # size; auto: dcp when the state is sharded (trainer.strategy=fsdp, ctx.shard), else full.
    checkpoint_format: str = "auto"
    # ddp: every rank holds the whole model (DistributedDataParallel). fsdp: FSDP2's
    # fully_shard per block and on the root; parameters, gradients and optimizer state are
    # split over the ranks (docs/your-code.md#models-larger-than-one-gpu).
    strategy: str = "ddp"
    # fsdp: free each block's gathered parameters after its forward (gathered again for the
    # backward): less memory, one more all-gather per block and step.
    reshard_after_forward: bool = True
    # fsdp: recompute each block's activations in the backward instead of keeping them.
    activation_checkpointing: bool = False
    seed: int = 0
    # auto (cuda when each task has a GPU) | cpu | cuda
    device: str = "auto"
    # auto | fp32 | bf16 | fp16 (CUDA, with a GradScaler). auto: bf16 autocast on CUDA, and on
    # a CPU with native bf16 (AVX512-BF16 or AMX, where it measured ~2x faster); else fp32.
    precision: str = "auto"
    # torch.use_deterministic_algorithms: a resumed run ends bitwise equal on CPU.
    deterministic: bool = True
    # Seconds a collective may wait before the run fails (NCCL's default is 10 minutes).
    collective_timeout_s: int = 300
    # Seconds for all ranks to join the rendezvous before the job fails naming the missing ones.
    rendezvous_timeout_s: int = 120
    # Seconds without any rank's training moving (its heartbeat through the supervisors'
    # store) before a supervised run counts as hung: every rank's stacks are dumped, the
    # ranks stuck outside torch are named, and all restart in place. None: the larger of 5
    # minutes and 10x the longest pause seen (a slow eval or checkpoint is not a hang).
    hang_timeout_s: float | None = None
    # Every this many optimizer steps the ranks agree (one tiny all-reduce, shared with the
    # log's, read at the next step) whether a stop signal arrived; a signal is acted on within
    # this many steps plus one.
    stop_check_interval: int = 10
    # Intra-op threads per rank; None: the task's CPUs (SLURM_CPUS_PER_TASK under Slurm,
    # else cluster.cpus_per_task).
    threads: int | None = None
    # Tuned defaults (docs/performance.md says what each one buys, measured). Each can be
    # switched; `python -m hpc_ddp.bench train` measures them against a plain DDP loop.
    # channels_last (NHWC) weights and batches for the conv nets. None (auto): on for them,
    # on CUDA and on CPU (measured on CPU: tiny CNN 1.16x, ResNet-18 1.06x).
    channels_last: bool | None = None
    # torch.compile the model (inductor). Off: tens of seconds or more of compilation at
    # every start and restart, which a run of short steps does not win back.
    compile: bool = False
    # Optimizer implementation. None (auto): fused (one kernel for all parameters) where torch
    # has it for the device; true: fused; false: torch's own default (foreach on CUDA, a
    # per-parameter loop on CPU).
    fused_optimizer: bool | None = None
    # DDP gradient bucket size in MiB. None: DDP's default, 25 MiB after a 1 MiB first bucket
    # (giving any number, 25 included, drops that small first bucket). Smaller buckets start
    # all-reduces earlier in the backward pass; larger ones mean fewer calls.
    ddp_bucket_cap_mb: int | None = None
    # DDP: gradients are views into the all-reduce buckets, saving one copy of them per step
    # and their memory. The values are the same either way.
    ddp_gradient_as_bucket_view: bool = True
    # DDP static_graph: the set of used parameters never changes (true for every model here);
    # DDP then skips re-checking it. Off: measured no faster (find_unused_parameters is off);
    # refused with grad_accum > 1 (DDP asserts when a static graph starts in no_sync).
    ddp_static_graph: bool = False
    # DDP's communication hook: how each gradient bucket is reduced (torch's own hooks;
    # docs/performance.md#gradient-compression-ddp-communication-hooks). none: DDP's all-reduce
    # in the gradients' dtype. fp16 / bf16: cast to 16 bits for the all-reduce (half the bytes),
    # back after it. powersgd: PowerSGD's low-rank compression with error feedback, whose
    # state each rank keeps in its checkpoint file. DDP only (refused under strategy=fsdp).
    ddp_comm_hook: str = "none"
    # powersgd: the rank of the low-rank approximation (torch's matrix_approximation_rank;
    # lower compresses more; 1-4 is usual).
    ddp_powersgd_rank: int = 1
    # powersgd: optimizer steps with a plain all-reduce before the compression starts (torch's
    # start_powerSGD_iter, at least 2; ~10% of the run is torch's advice).
    ddp_powersgd_warmup_steps: int = 1000
    # With trainer.deterministic, torch also fills every new tensor with NaN so that a read of
    # uninitialised memory shows up (a debugging aid; torch.utils.deterministic). Off: the
    # same results, since no kernel reads memory it did not write, without a memset per
    # tensor per step.
    fill_uninitialized_memory: bool = False
    # On CPU, keep freed memory in the process (glibc mallopt, hpc_ddp/trainer/cpu_memory.py) rather
    # than returning it to the kernel and faulting it back in every step; the resident memory
    # then stays at its peak. Process-wide, set when the trainer starts.
    keep_freed_memory: bool = True


@dataclass
class SweepConfig:
    # Folder of a multirun (-m): one run dir per point inside; None: multirun/<date>_<time>.
    dir: str | None = None
    # Points per Slurm job array; None: the cluster's MaxArraySize (scontrol show config).
    max_array_size: int | None = None
    # Points running at once: the array's %N on Slurm, processes at once on a local sweep.
    parallel: int | None = None


@dataclass
class SecretsConfig:
    # Names whose values are secrets though hpc_ddp's rules do not say so (docs/security.md):
    # environment variables (MY_DB_CONN), keys of your parts and app (model.db_url, or db_url
    # for every part), a script's flags (--db). Their values travel like any secret's.
    secret: list[str] = field(default_factory=list)
    # Names the rules take for secrets that are not (model.pad_token): written as given.
    public: list[str] = field(default_factory=list)


@dataclass
class TrackerConfig:
    # The W&B project and the MLflow experiment the runs go to.
    project: str = "hpc_ddp"
    # W&B offline (sync later) or online; null: online only where the job has WANDB_API_KEY
    # or WANDB_MODE=online (compute nodes often have no internet).
    offline: bool | None = None


@dataclass
class Config:
    # Shortcuts a user types on the command line.
    nodes: int = 1
    run_dir: str | None = None
    # Follow the job to its end (None: yes for local runs, no for Slurm).
    wait: bool | None = None
    # A local run or a step that outlives the terminal: the ranks in their own session, the
    # command returns at once with the commands to follow and stop it (docs/observability.md).
    detach: bool = False
    # Continue run_dir from its latest checkpoint.
    resume: bool = False
    # Print what would be submitted and submit nothing.
    dry_run: bool = False
    # Run the doctor's checks on the requested nodes first; submit only if they pass.
    preflight: bool = False
    # What runs on every rank instead of the built-in trainer (docs/your-code.md); at most one.
    # entry: "my_pkg.train:main", a function called with a hpc_ddp.Context after the rank
    # joined the job. script: a torchrun-style script run unchanged ("train.py", or
    # "-m my_pkg.train" for a module), with the torchrun variables set; script_args: its
    # arguments (on the command line: everything after `--`).
    entry: str | None = None
    script: str | None = None
    script_args: list[str] = field(default_factory=list)
    # Your config folder, searched before hpc_ddp's conf/ (--config-dir on the command line,
    # $HPC_DDP_CONFIG_DIR for sbatch wrappers): your own options of any group, or a
    # config.yaml of your own.
    config_dir: str | None = None
    # Build every `_target_` part on the submit host before submitting (the model on the meta
    # device, the data sets for real) so that a bad one is refused there. false: leave it to
    # the ranks (for data sets too large to open on a login node).
    check_targets: bool = True
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    nccl: NcclConfig = field(default_factory=NcclConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    secrets: SecretsConfig = field(default_factory=SecretsConfig)
    # Experiment trackers beside TensorBoard (always on): wandb, mlflow, or a list of them
    # (logger=[wandb,mlflow]); rank 0 logs to them (docs/observability.md).
    logger: Any = "tensorboard"
    tracker: TrackerConfig = field(default_factory=TrackerConfig)
    # Your own keys (conf/app/<option>.yaml, or app.<key>=... on the command line), free-form;
    # a function entry reads them as ctx.app.
    app: dict[str, Any] = field(default_factory=dict)


__all__ = ["ClusterConfig", "Config", "ContainerConfig", "DataConfig", "LossConfig",
           "MetricsConfig", "ModelConfig", "NcclConfig", "OptimConfig", "SchedulerConfig",
           "SecretsConfig", "SweepConfig", "TrainerConfig", "register_schemas"]

GROUPS: tuple[str, ...] = ("cluster", "container", "model", "data", "loss", "optim",
                           "scheduler", "metrics", "trainer", "nccl", "app")
# The groups a `_target_` may build (config/parts.py), with their schemas.
PARTS: dict[str, type] = {"model": ModelConfig, "data": DataConfig, "loss": LossConfig,
                          "optim": OptimConfig, "scheduler": SchedulerConfig,
                          "metrics": MetricsConfig}
# Free-form groups: any key may be set (app.<key>=... needs no +).
FREE_FORM = ("app",)


def register_schemas() -> None:
    """Register the schema Hydra composes into (idempotent; called before composing).

    It is :class:`Config` with the parts and ``app`` left untyped, so a `_target_` node may
    carry any keyword argument; config/parts.py checks and types them right after.
    """
    from hydra.core.config_store import ConfigStore  # deferred: hydra

    ConfigStore.instance().store(name="hpc_ddp_schema", node=compose_schema())


@functools.cache
def compose_schema() -> type:
    """:class:`Config` with the part groups and ``app`` typed ``Any`` (made once)."""
    hints = typing.get_type_hints(Config)
    loose: list[tuple[str, Any, Any]] = []
    for f in dataclasses.fields(Config):
        if f.name in PARTS or f.name in FREE_FORM:
            loose.append((f.name, Any, field(default=None)))
        else:
            loose.append((f.name, hints[f.name], field(default=f.default,
                                                      default_factory=f.default_factory)))
    made = dataclasses.make_dataclass("ComposedConfig", loose)
    made.__module__ = __name__
    globals()["ComposedConfig"] = made  # found by name: a composed node can be pickled
    return made
