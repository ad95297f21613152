"""hpc_ddp: PyTorch DDP from a Hydra config to a multi-node Slurm job (or local processes).

Nothing happens at import time; heavy modules (torch, submitit, hydra) load where used.
"""

__version__ = "0.1.0"
