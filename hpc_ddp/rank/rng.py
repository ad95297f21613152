"""Every random stream of a rank, captured and restored, so a resume continues them exactly."""

from __future__ import annotations

import random
from typing import Any


def capture(extra: dict[str, Any]) -> dict[str, Any]:
    """States of python, numpy, torch (CPU and CUDA) and the given torch Generators."""
    import numpy as np
    import torch

    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "generators": {name: gen.get_state() for name, gen in extra.items()},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def gather_states(extra: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's :func:`capture`, in rank order (a collective: every rank calls it), for
    rank 0's checkpoint."""
    import torch.distributed as dist

    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, capture(extra))
    return states


def restore(state: dict[str, Any], extra: dict[str, Any]) -> None:
    """Set every stream back; the states may come loaded onto any device (torch wants CPU
    byte tensors, whatever map_location a checkpoint was read with)."""
    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"].cpu())
    for name, gen in extra.items():
        gen.set_state(state["generators"][name].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu())


def seed_all(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
