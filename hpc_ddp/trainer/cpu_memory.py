"""Keep freed memory in a CPU rank's process instead of faulting it back in every step.

glibc hands large blocks (above a threshold it raises up to 32 MiB as blocks are freed)
straight back to the kernel and trims the heap's top when 128 KiB or more lies free there.
A training step frees and re-allocates the same activations and gradients every time, so
on CPU each step then faults hundreds of MB back in page by page: ~10,000-100,000 minor
page faults a step for ResNet-18 at batch 64, 2-8% of its step time, and how many depends
on the heap's history (docs/performance.md). ``mallopt`` with a fixed mmap threshold of
32 MiB (glibc's maximum) and no trimming keeps freed blocks for the next step; the
process's resident memory then stays at its peak. Blocks above 32 MiB are still mapped
and unmapped each time. Not glibc (musl, macOS): nothing happens.
"""

from __future__ import annotations

# glibc's malloc.h.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 * 2**20  # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
NEVER_TRIM = 2**31 - 1

_applied = False


def _mallopt(param: int, value: int) -> bool:
    """glibc's mallopt(3); False where it is not there (musl, macOS) or refuses."""
    # deferred: ctypes
    import ctypes
    import ctypes.util

    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(param, value))


def keep_freed_memory() -> bool:
    """Apply the settings (once per process); True if glibc took them."""
    global _applied
    if not _applied:
        _applied = _mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) and _mallopt(
            M_TRIM_THRESHOLD, NEVER_TRIM)
    return _applied


def map_large_blocks_alone(threshold: int) -> bool:
    """The opposite, for measuring memory: blocks above ``threshold`` bytes are mapped on
    their own and go back to the kernel when freed, and the threshold stays fixed (glibc
    stops raising it), so the resident peak is the peak of what was in use. True if glibc
    took it."""
    return _mallopt(M_MMAP_THRESHOLD, threshold)
