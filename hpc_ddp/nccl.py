"""NCCL/Gloo/torch.distributed environment of a task: one rule, every override logged.

The rule: a variable the profile sets (nccl.env, nccl.extra_env) overrides what the site or
user exported, and the override is logged with both values; a variable the profile does not
set is left exactly as exported. Applied before the process group exists, since NCCL reads
its variables once at initialisation (https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

from hpc_ddp.config.nccl_schema import NcclConfig

log = logging.getLogger(__name__)

# Variables worth recording for every rank (what NCCL, Gloo and torch.distributed read).
RECORDED = re.compile(r"^(NCCL_|TORCH_|GLOO_|MASTER_|CUDA_|SLURM_|OMP_|UCX_|FI_)")
_SECRET = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)


@dataclass(frozen=True)
class EnvChange:
    name: str
    old: str | None
    new: str


def planned_changes(cfg: NcclConfig, environ: Mapping[str, str]) -> list[EnvChange]:
    """What applying the profile to ``environ`` changes (unchanged values are left out)."""
    wanted = {**cfg.env, **cfg.extra_env}
    return [EnvChange(k, environ.get(k), str(v)) for k, v in sorted(wanted.items())
            if environ.get(k) != str(v)]


def mask(name: str, value: str) -> str:
    """Values of secret-looking variables never reach a file or a log."""
    return "****" if _SECRET.search(name) else value


def recorded_env(environ: Mapping[str, str]) -> dict[str, str]:
    return {k: mask(k, v) for k, v in sorted(environ.items()) if RECORDED.match(k)}


def apply(cfg: NcclConfig, environ: MutableMapping[str, str]) -> list[EnvChange]:
    """Export the profile into ``environ`` (the task's os.environ), logging every change."""
    changes = planned_changes(cfg, environ)
    for change in changes:
        if change.old is None:
            log.info("env: %s=%s (profile %s)", change.name, mask(change.name, change.new),
                     cfg.profile)
        else:
            log.warning("env: %s=%s overrides the exported %s (profile %s)", change.name,
                        mask(change.name, change.new), mask(change.name, change.old),
                        cfg.profile)
        environ[change.name] = change.new
    return changes
