"""A sweep's points and their secrets: one job array shares one environment."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hpc_ddp.config.compose import from_yaml, to_yaml
from hpc_ddp.config.secret_channels import PREFIX, reference


def per_point(points: Sequence[tuple[Any, list[str], dict[str, str]]]
              ) -> list[tuple[Any, list[str], dict[str, str]]]:
    """Sweep points as (config, overrides, name -> secret value): a job array shares one
    environment, so a variable that carries another value in a later point is renamed there
    (HPC_DDP_SECRET_P<index>_NAME, in its config and overrides) and carries that one."""
    taken: dict[str, str] = {}
    out = []
    for index, (cfg, overrides, hidden) in enumerate(points):
        renames = {}
        for name, value in hidden.items():
            if taken.setdefault(name, value) != value:
                renames[name] = f"{PREFIX}P{index}_{name.removeprefix(PREFIX)}"
        if renames:
            text = to_yaml(cfg)
            for old, new in renames.items():
                text = text.replace(reference(old), reference(new))
                overrides = [o.replace(reference(old), reference(new)) for o in overrides]
            cfg = from_yaml(text)
            hidden = {renames.get(k, k): v for k, v in hidden.items()}
            taken.update(hidden)
        out.append((cfg, overrides, hidden))
    return out
