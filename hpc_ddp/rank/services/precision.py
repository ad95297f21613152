"""trainer.precision's ``auto`` resolved for a device: the built-in trainer's DDP and FSDP
paths and a user's ``ctx.shard`` share it (docs/performance.md has the measurements)."""

from __future__ import annotations

from typing import Any


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: bf16 matrix kernels in hardware, not emulated."""
    import torch  # deferred: torch

    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)


def resolve_precision(precision: str, device: Any) -> str:
    """trainer.precision with auto resolved for ``device``."""
    if precision != "auto":
        return precision
    if device.type == "cuda":
        return "bf16"
    # On CPU only where it measured faster: native bf16 (~2x for ResNet-18 on a Zen 4).
    return "bf16" if cpu_has_native_bf16() else "fp32"
