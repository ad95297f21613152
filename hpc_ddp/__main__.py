"""``python -m hpc_ddp``: the commands there are (each has --help)."""

from __future__ import annotations

import sys

COMMANDS = """hpc_ddp: DDP training from a Hydra config to a (multi-node) Slurm job.

  python -m hpc_ddp.submit [key=value ...]       submit a run (local without Slurm); -m: a sweep
      --config-dir DIR   your config folder first; entry=pkg.mod:main or script=x.py -- args:
                         your own loop or torchrun script (docs/your-code.md)
  python -m hpc_ddp.status <run_dir|sweep_dir>   states, steps, losses, cost; --watch, --stop,
                                                 --cancel, --plot
  python -m hpc_ddp.logs <run_dir|sweep_dir>     every rank's output in time order; --rank N,
                                                 --grep, --since, --follow, --point N
  python -m hpc_ddp.collect <handle> [--checkpoint]  a remote run's results on this machine
                                                 (submit cluster.remote=HOST: docs/remote.md)
  python -m hpc_ddp.checkpoint export RUN [--step N] OUT   a checkpoint as one plain file
  python -m hpc_ddp.train [key=value ...]        one rank's entry, under srun (jobs/*.sbatch)
  python -m hpc_ddp.doctor [key=value ...]       check the nodes of a job before training
  python -m hpc_ddp.env venv|conda DIR|NAME      build the environment every node activates
      container=pyxis|apptainer|podman, cluster.venv=DIR: see docs/containers.md
  python -m hpc_ddp.bench comm|train|scaling|sweep|search|entries|data|scale|logs|\
recovery|startup|warm|checkpoint
      communication, training, scaling over nodes, submission, an adaptive search in
      batches/asynchronous/pruned, what your own code pays,
      data loading, per-rank cost against world size, the logs command on 4,096 ranks,
      what a failure costs (in place vs requeue), checkpoint stalls and FSDP against DDP
  python -m hpc_ddp.data download cifar10 root=DIR   fetch a data set once, before training
  python -m hpc_ddp.data pack SRC DST [--replace]    pack images into WebDataset shards
  python -m hpc_ddp.testcluster up|down|status   a real Slurm cluster on this machine (root)
      shape --rate 300mbit [--delay 1ms], straggle --node node3 --cpu 0.5: slow it down

Docs: docs/quickstart.md; every key: docs/configuration.md."""


def main() -> int:
    print(COMMANDS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
