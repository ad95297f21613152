"""A step's task (rank/main/step.py) that handles the stop signals as a rank's program does,
ends, and leaves objects that take ~1 s to free when the interpreter exits: the moment a late
signal from Slurm used to end a finished task (rank/services/process_exit.py, ``ended``)."""

from __future__ import annotations

import time
from pathlib import Path

KEPT: list[object] = []


class _SlowToFree:
    def __del__(self) -> None:
        time.sleep(0.001)


class HandlesThenEnds:
    def __init__(self, done: str) -> None:
        self.done = done

    def __call__(self) -> None:
        from hpc_ddp.rank.services.stopping import StopRequest

        StopRequest().install("USR2")  # as the rank's program does
        KEPT.extend(_SlowToFree() for _ in range(800))  # freed at the interpreter's exit
        Path(self.done).write_text("ended")
