"""Benchmarks, run as jobs through the same path as training (local or Slurm).

    python -m hpc_ddp.bench                                    # lists the benchmarks
    python -m hpc_ddp.bench comm [options] [key=value ...]     # collectives vs raw TCP

Subcommands (``hpc_ddp/bench/__main__.py``):
  comm   all_reduce, all_gather and reduce_scatter bandwidth by message size (nccl-tests'
         definitions), and on several nodes the raw TCP bandwidth between two of them
         (``hpc_ddp/bench/comm.py``).
  train  training throughput and the step split of hpc_ddp's trainer against a hand-written
         DDP loop in the same run (``hpc_ddp/bench/train.py``, docs/performance.md).
  scaling  your training on 1, 2, ... N nodes of one job: samples/s, efficiency, the step
         split, the all-reduce bandwidth achieved against the bare one, a verdict naming the
         bottleneck, and on a slow fabric each sync fix measured with the override line to
         use (``hpc_ddp/bench/scaling.py``, docs/performance.md#the-scaling-report).
  sweep  seconds to submit a large sweep, every job held: job arrays vs one sbatch per
         point vs a bare sbatch loop, and where the time goes per point
         (``hpc_ddp/bench/sweep.py``, docs/sweeps.md).
  entries  what running your own code costs: a function entry's step against the same loop
         bare, and (--slurm-nodes N) a script under script= against a bare srun
         (``hpc_ddp/bench/entries.py``, docs/your-code.md).
  data   images/s per core of the image-folder and shards loaders against the textbook
         ImageFolder + PIL + DataLoader, same workers, and staging rates
         (``hpc_ddp/bench/data.py``, docs/data.md).
  scale  what one rank costs (store, files, Slurm calls) at start-up, a checkpoint, a
         resume and a failure, for simulated worlds of 8 to 8192 ranks, and reading a
         10,000-node job's lists (``hpc_ddp/bench/scale.py``, docs/performance.md).
"""
