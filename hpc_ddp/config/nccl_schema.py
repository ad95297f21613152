"""Schema of the ``nccl`` group: the NCCL / Gloo / torch.distributed environment of a task."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from hpc_ddp.errors import UserError


@dataclass
class NcclConfig:
    # Profile name (conf/nccl/<profile>.yaml).
    profile: str = "default"
    # Variables exported in every task before the process group exists. Values the site
    # already exported are kept unless listed here (see docs/configuration.md).
    env: dict[str, str] = field(default_factory=dict)
    # Anything else, exported the same way.
    extra_env: dict[str, str] = field(default_factory=dict)


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def validate_nccl(cfg: NcclConfig) -> None:
    """Refuse what cannot be exported; UserError names the variable and the fix."""
    for section, values in (("nccl.env", cfg.env), ("nccl.extra_env", cfg.extra_env)):
        for name, value in values.items():
            if not _ENV_NAME.match(name):
                raise UserError(f"{section}.{name}", value, "is not an environment variable name.",
                                "use letters, digits and _ only, e.g. NCCL_DEBUG.")
