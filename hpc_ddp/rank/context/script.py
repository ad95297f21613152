"""``hpc_ddp.context()`` inside a script hpc_ddp started (``script=``): the same Context a
function entry gets, made from the environment the supervisor (rank/supervise/script.py)
gave the script.

The script may have made its process group already (``init_process_group`` with the
torchrun variables); if not, this makes it. Its own signal handlers keep working: ours are
chained in front of them.
"""

from __future__ import annotations

import atexit
import os
import socket
from collections.abc import Mapping
from pathlib import Path

from hpc_ddp.owned import read_owned
from hpc_ddp.rank.context.context import Context
from hpc_ddp.rank.contract import RESUME_CAUSE_ENV, RUN_DIR_ENV, STOP_FILE_ENV
from hpc_ddp.rank.join.distenv import detect
from hpc_ddp.rank.services.stopping import StopRequest
from hpc_ddp.rundir import RunDir


def from_environment(environ: Mapping[str, str] | None = None) -> Context:
    """The Context of this script's rank; RuntimeError outside a run hpc_ddp started."""
    import torch.distributed as dist  # deferred: hostlist, torch; start-up: config.compose

    from hpc_ddp.config.compose import from_yaml
    from hpc_ddp.rank.join.joined import choose_device

    environ = os.environ if environ is None else environ
    if not environ.get(RUN_DIR_ENV):
        raise RuntimeError(
            "hpc_ddp.context() works in a program hpc_ddp runs (python -m hpc_ddp.submit "
            "entry=... or script=...); this process was not started that way. A plain "
            "torchrun script needs no context: hpc_ddp sets RANK, WORLD_SIZE, MASTER_ADDR.")
    run = RunDir(Path(environ[RUN_DIR_ENV]))
    # Its `_target_` parts are code: read only if no one else could have written it.
    cfg = from_yaml(read_owned(run.config, run.root).decode())
    env = detect(environ)
    device, _ = choose_device(cfg, env, dict(environ), use=False)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    stop = StopRequest()
    stop.install(cfg.cluster.signal, chain=True)
    ctx = Context(cfg, run, env, device, socket.gethostname(), stop,
                  environ.get(RESUME_CAUSE_ENV),
                  stop_file=Path(environ[STOP_FILE_ENV]) if environ.get(STOP_FILE_ENV) else None)
    atexit.register(ctx.close)  # TensorBoard flushed, ctx.summary handed to the supervisor
    return ctx
