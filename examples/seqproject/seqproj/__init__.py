"""A small user project: a tiny transformer that regresses a property of generated sequences.

It knows nothing of hpc_ddp except where it chooses to (loop.py takes hpc_ddp's context);
hpc_ddp trains it through `_target_` configs (conf/), a function entry (loop.py) or as the
unchanged torchrun-style script train_ddp.py.
"""
