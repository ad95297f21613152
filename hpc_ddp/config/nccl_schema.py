"""Schema of the ``nccl`` group: the NCCL / Gloo / torch.distributed environment of a task."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class NcclConfig:
    # Profile name (conf/nccl/<profile>.yaml).
    profile: str = "default"
    # Variables exported in every task before the process group exists. Values the site
    # already exported are kept unless listed here (see docs/configuration.md).
    env: dict[str, str] = field(default_factory=dict)
    # Anything else, exported the same way.
    extra_env: dict[str, str] = field(default_factory=dict)
