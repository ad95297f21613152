"""Where a sweep's submission spends its time, by phase, for ``python -m hpc_ddp.bench sweep``.

``HPC_DDP_SWEEP_SPLIT=<file>`` makes ``python -m hpc_ddp.submit -m ...`` write the split there
as JSON: start-up (interpreter and imports, until the sweep is read), composition, planning
(each point's checks), folders (run dirs and their files), submission (submitit's pickles and
the sbatch calls), the rest (expanding the sweep, the manifest, the table), and the sbatch
calls made.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

SPLIT_ENV = "HPC_DDP_SWEEP_SPLIT"


class Phases:
    def __init__(self) -> None:
        self.created = time.time()
        self.seconds: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    @contextmanager
    def timed(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started

    def count(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n

    def write(self, environ: Mapping[str, str], points: int) -> None:
        """The split into $HPC_DDP_SWEEP_SPLIT, if set (start-up: from the process's start to
        this object's creation)."""
        target = environ.get(SPLIT_ENV)
        if not target:
            return
        import psutil  # deferred: psutil

        started = psutil.Process(os.getpid()).create_time()
        total = time.time() - started
        startup = self.created - started
        rest = total - startup - sum(self.seconds.values())
        seconds = {"start-up": startup, **self.seconds, "the rest": rest}
        Path(target).write_text(json.dumps({"points": points, "total_s": total,
                                            "seconds": seconds, "counts": self.counts},
                                           indent=2))
