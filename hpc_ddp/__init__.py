"""hpc_ddp: PyTorch DDP from a Hydra config to a multi-node Slurm job (or local processes).

The Python API (docs/api.md)::

    import hpc_ddp
    run = hpc_ddp.submit(["trainer.max_steps=100", "run_dir=/tmp/r1"])
    summary = run.wait()

Nothing happens at import time; heavy modules (torch, submitit, hydra) load where used.
"""

from __future__ import annotations

import importlib
from typing import Any

from hpc_ddp.version import VERSION as __version__

# Re-exported lazily (PEP 562), so `import hpc_ddp` stays instant.
_API = {"compose": "hpc_ddp.api", "plan": "hpc_ddp.api", "plan_many": "hpc_ddp.api",
        # here, or with cluster.remote=HOST on a cluster over SSH (docs/remote.md)
        "submit": "hpc_ddp.remote.api", "open_run": "hpc_ddp.remote.api",
        "RemoteRun": "hpc_ddp.remote.run", "Run": "hpc_ddp.api", "RunFailed": "hpc_ddp.api",
        "Plan": "hpc_ddp.api",
        "UserError": "hpc_ddp.errors", "check_data": "hpc_ddp.datacheck",
        # On every rank: the context of your own training (docs/your-code.md).
        "Context": "hpc_ddp.rank.context.context", "REQUEUE_EXIT_CODE": "hpc_ddp.rank.contract"}
__all__ = [*_API, "__version__", "context"]


def context() -> Any:
    """This rank's :class:`Context`, in a function entry or a script hpc_ddp started."""
    from hpc_ddp.rank.context.current import current  # deferred: the typed schemas

    return current()


def __getattr__(name: str) -> Any:
    if name in _API:

        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'hpc_ddp' has no attribute {name!r}")
