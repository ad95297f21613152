"""Where a training step's time goes, measured from outside the loop.

A :class:`StepTimer` watches any DDP loop — hpc_ddp's trainer or a hand-written one — without
a line in it: it wraps the loader (time blocked in ``next``), hooks every parameter
(``register_post_accumulate_grad_hook``: the last one marks the end of the backward
computation) and the optimizer (step pre/post hooks). A step then splits into

    data      waiting for the next batch
    compute   forward + backward, from the batch in hand to the last gradient computed
    comm      from the last gradient to optimizer.step: all-reduces not hidden by backward
    optimizer optimizer.step
    other     the rest of the wall time (the loop itself, zero_grad, logging, the framework)

On CUDA the compute, comm and optimizer marks are CUDA events on the current stream (GPU
time, nothing synchronises inside the window); on CPU they are ``perf_counter`` readings.
``comm`` over the step's wall time is the share of a step spent waiting on gradient sync
(:func:`sync_share`): the one split the benchmark's table, the trainer's sampled steps
(trainer/sync_probe.py) and a run's summary share.
Peak memory per window: the CUDA allocator's peak, or on CPU the process's peak resident set
(``VmHWM``, reset through ``/proc/self/clear_refs``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

PHASES = ("data", "compute", "comm", "optimizer", "other")


@dataclass(frozen=True)
class Window:
    """One timed stretch of steps; phase times in seconds, summed over its steps."""

    steps: int
    wall_s: float
    data_s: float
    compute_s: float
    comm_s: float
    optimizer_s: float
    peak_mem_mb: float | None
    # What peak_mem_mb is: "cuda_allocated", "cpu_rss" (the whole process), or "none" (not
    # measured: StepTimer(memory=False)).
    mem_kind: str
    # Memory the window's steps added on top of what was resident when it began (MB).
    step_mem_mb: float | None

    @property
    def other_s(self) -> float:
        return max(0.0, self.wall_s - self.data_s - self.compute_s - self.comm_s
                   - self.optimizer_s)

    @property
    def sync_share(self) -> float | None:
        return sync_share(self.comm_s, self.wall_s)

    def per_step_ms(self) -> dict[str, float]:
        n = max(self.steps, 1)
        out = {p: getattr(self, f"{p}_s") * 1e3 / n for p in PHASES}
        out["step"] = self.wall_s * 1e3 / n
        return out

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "other_s": self.other_s}


def sync_share(comm: float, step: float) -> float | None:
    """The share of a step spent waiting on gradient sync: the exposed all-reduce (``comm``,
    from the last gradient computed to ``optimizer.step``) over the step's wall time, in the
    same unit; clipped to [0, 1] (the two come from different clocks on CUDA: events against
    the host's). None for a step of no length."""
    if not step > 0:
        return None
    return min(1.0, max(0.0, comm / step))


def mark(cuda: bool) -> Any:
    """A point in time: a CUDA event recorded on the current stream (GPU time, nothing
    synchronises), or on CPU a perf_counter reading."""
    if not cuda:
        return time.perf_counter()
    import torch  # deferred: torch

    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


class StepTimer:
    """Attach to a model's parameters, its optimizer and its loader; time windows of steps."""

    def __init__(self, device: Any, memory: bool = True,
                 after_step: Callable[[], None] | None = None) -> None:
        """``memory``: measure each window's peak memory (resetting the process's peak
        counters at :meth:`start`: off where another timer's windows read them);
        ``after_step``: called at the end of each optimizer step seen."""
        self.cuda = getattr(device, "type", "cpu") == "cuda"
        self.device = device
        self.memory = memory
        self.after_step = after_step
        self._handles: list[Any] = []
        self._final: Any = None  # the parameter whose gradient is computed last
        self._last_param: Any = None
        self._reset_marks()

    # -- attaching ---------------------------------------------------------------------------
    def attach(self, parameters: Iterable[Any], optimizer: Any) -> StepTimer:
        self.attach_parameters(parameters)
        self._handles.append(optimizer.register_step_pre_hook(self._on_step_begin))
        self._handles.append(optimizer.register_step_post_hook(self._on_step_end))
        return self

    def attach_parameters(self, parameters: Iterable[Any]) -> None:
        """The parameters' hooks alone, for a caller that reports the optimizer's step itself
        (:meth:`step_begins`, :meth:`step_ends`: sync_probe.LoopProbe's global hooks)."""
        for p in parameters:
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def step_begins(self) -> None:
        self._on_step_begin(None, (), {})

    def step_ends(self) -> None:
        self._on_step_end(None, (), {})

    def wrap(self, loader: Any) -> TimedLoader:
        """``loader`` with the time spent in each ``next`` counted as data wait."""
        return TimedLoader(loader, self)

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # -- windows -----------------------------------------------------------------------------
    def start(self) -> None:
        """Begin a window (call between steps)."""
        self._sync()
        self._reset_marks()
        self._mem_start = _reset_peak_memory(self.device) if self.memory else None
        self._wall_start = time.perf_counter()

    def stop(self, steps: int) -> Window:
        """End the window that began at :meth:`start`; ``steps`` optimizer steps ran in it."""
        self._sync()
        wall = time.perf_counter() - self._wall_start
        sums = {name: sum(self._elapsed(a, b) for a, b in pairs)
                for name, pairs in self._pairs.items()}
        peak, kind = _peak_memory(self.device) if self.memory else (None, "none")
        delta = None if peak is None or self._mem_start is None else peak - self._mem_start
        return Window(steps, wall, self._data_s, sums["compute"], sums["comm"],
                      sums["optimizer"], peak, kind, delta)

    # -- hooks ---------------------------------------------------------------------------------
    def _reset_marks(self) -> None:
        self._pairs: dict[str, list[tuple[Any, Any]]] = {"compute": [], "comm": [],
                                                          "optimizer": []}
        self._data_s = 0.0
        self._ready: Any = None  # the batch was in hand
        self._grad: Any = None  # the latest "last gradient" mark since the batch
        self._step_begin: Any = None

    def _mark(self) -> Any:
        return mark(self.cuda)

    def _elapsed(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a

    def _sync(self) -> None:
        if self.cuda:
            import torch  # deferred: torch

            torch.cuda.synchronize(self.device)

    def data_wait(self, seconds: float) -> None:
        """Called by the loader wrapper once a batch is in hand."""
        self._close_compute()  # a micro-batch without an optimizer step (no_sync)
        self._data_s += seconds
        self._ready = self._mark()
        self._grad = None

    def _on_grad(self, param: Any) -> None:
        # Only the parameter computed last matters; after one step we know which it is.
        if self._final is None or param is self._final:
            self._grad = self._mark()
            self._last_param = param

    def _close_compute(self) -> None:
        if self._ready is not None and self._grad is not None:
            self._pairs["compute"].append((self._ready, self._grad))
        self._ready = None

    def _on_step_begin(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._final is None:
            self._final = self._last_param
        grad = self._grad
        self._close_compute()
        self._step_begin = self._mark()
        if grad is not None:
            self._pairs["comm"].append((grad, self._step_begin))
        self._grad = None

    def _on_step_end(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._step_begin is not None:
            self._pairs["optimizer"].append((self._step_begin, self._mark()))
            self._step_begin = None
            if self.after_step is not None:
                self.after_step()


class TimedLoader:
    """Iterates like the wrapped loader; every other attribute is the loader's."""

    def __init__(self, loader: Any, timer: StepTimer) -> None:
        self.loader = loader
        self.timer = timer

    def __iter__(self) -> Iterator[Any]:
        it = iter(self.loader)
        while True:
            start = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                return
            self.timer.data_wait(time.perf_counter() - start)
            yield batch

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _reset_peak_memory(device: Any) -> float | None:
    """Reset the peak-memory counter; returns the memory in use now (MB)."""
    if getattr(device, "type", "cpu") == "cuda":
        import torch  # deferred: torch

        torch.cuda.reset_peak_memory_stats(device)
        return float(torch.cuda.memory_allocated(device)) / 2**20
    try:
        _CLEAR_REFS.write_text("5")  # "5": reset the peak RSS (proc(5), Linux >= 4.0)
    except OSError:
        pass
    return _status_mb("VmRSS")


def _peak_memory(device: Any) -> tuple[float | None, str]:
    if getattr(device, "type", "cpu") == "cuda":
        import torch  # deferred: torch

        return float(torch.cuda.max_memory_allocated(device)) / 2**20, "cuda_allocated"
    return _status_mb("VmHWM"), "cpu_rss"


def _status_mb(field: str) -> float | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None
