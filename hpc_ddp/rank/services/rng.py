"""Every random stream of a rank, captured and restored, so a resume continues them exactly.

A captured state holds only tensors and plain Python values (numpy's key array travels as a
tensor), so a checkpoint holding it loads with ``torch.load(weights_only=True)``: nothing in
it is code (docs/security.md). Each rank saves its own state in its own small file beside the
checkpoint (hpc_ddp/rank/services/ckpt_writer.py) and reads back only that one at a resume: no rank
sends or receives another's, whatever the world size.
"""

from __future__ import annotations

import os
import random
import sys
from typing import Any


def capture(extra: dict[str, Any]) -> dict[str, Any]:
    """States of python, numpy, torch (CPU and CUDA) and the given torch Generators (copies:
    the streams may go on at once)."""
    # deferred: numpy, torch
    import numpy as np
    import torch

    version, keys, gauss = random.getstate()
    state: dict[str, Any] = {
        "python": [version, list(keys), gauss],
        "numpy": numpy_state(np.random.get_state(legacy=True)),
        "torch": torch.get_rng_state(),
        "generators": {name: gen.get_state() for name, gen in extra.items()},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore(state: dict[str, Any], extra: dict[str, Any]) -> None:
    """Set every stream back; the states may come loaded onto any device (torch wants CPU
    byte tensors, whatever map_location a checkpoint was read with)."""
    # deferred: numpy, torch
    import numpy as np
    import torch

    version, keys, gauss = state["python"]
    random.setstate((int(version), tuple(int(k) for k in keys), gauss))
    np.random.set_state(numpy_tuple(state["numpy"]))
    torch.set_rng_state(state["torch"].cpu())
    for name, gen in extra.items():
        gen.set_state(state["generators"][name].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu())


def numpy_state(legacy: Any) -> dict[str, Any]:
    """A NumPy RandomState's legacy state tuple ``(name, keys, pos, has_gauss, cached)`` as
    data: its key array as a tensor (a checkpoint loads with weights_only)."""
    # deferred: numpy, torch
    import numpy as np
    import torch

    kind, mt, pos, has_gauss, cached = legacy
    assert isinstance(mt, np.ndarray)  # the legacy tuple form: (name, keys, pos, ...)
    return {"kind": str(kind), "keys": torch.from_numpy(mt.astype(np.int64)),
            "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)}


def numpy_tuple(state: dict[str, Any]) -> tuple[Any, ...]:
    """:func:`numpy_state` back as the tuple ``RandomState.set_state`` takes."""
    import numpy as np  # deferred: numpy

    return (state["kind"], state["keys"].cpu().numpy().astype(np.uint32), state["pos"],
            state["has_gauss"], state["cached"])


def seed_all(seed: int) -> None:
    # deferred: numpy, torch
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def deterministic_kernels(on: bool) -> None:
    """trainer.deterministic: torch's deterministic algorithms (warnings where an op has
    none), and oneDNN's, which torch's switch leaves alone: its bf16 CPU kernels otherwise
    pick an algorithm by memory alignment, and two identical runs drift apart (seen here:
    torchvision's ResNet-18 in bf16, two runs differing after 4 steps).
    https://pytorch.org/docs/stable/notes/randomness.html"""
    import torch  # deferred: torch

    if "torch._inductor.config" in sys.modules:
        torch.use_deterministic_algorithms(on, warn_only=True)
    else:
        # torch.use_deterministic_algorithms imports torch._inductor.config only to set its
        # `deterministic` flag, and with it dynamo and inductor: 1.3 s of every rank's start
        # on an idle machine, 3.5-6 s under load (issue 46: the gap between a rank's env: and
        # rendezvous: lines), for a model that may never be compiled. The same switch without
        # that import; inductor reads its flag from this variable when it is imported
        # (torch/_inductor/config.py: deterministic = TORCHINDUCTOR_DETERMINISTIC == "1").
        os.environ["TORCHINDUCTOR_DETERMINISTIC"] = "1" if on else "0"
        torch._C._set_deterministic_algorithms(on, warn_only=True)
    if hasattr(torch.backends.mkldnn, "deterministic"):  # torch >= 2.6
        torch.backends.mkldnn.deterministic = on  # type: ignore[assignment]
