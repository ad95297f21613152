"""Where hpc_ddp's own config folder is (conf/ beside the package, or $HPC_DDP_CONF)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

CONF_ENV = "HPC_DDP_CONF"


def conf_dir(environ: Mapping[str, str] | None = None) -> Path:
    """hpc_ddp's config folder: ``$HPC_DDP_CONF`` if set, else ``conf/`` beside the package."""
    environ = os.environ if environ is None else environ
    if environ.get(CONF_ENV):
        return Path(environ[CONF_ENV]).resolve()
    return Path(__file__).resolve().parents[2] / "conf"
