"""Slurm's output as the test cluster printed it (Slurm 22.05.8), for the parsers' tests,
and fake Slurm commands on PATH that print it and log every call.

Captured with the commands hpc_ddp runs (slurm_state.squeue_command / sacct_command,
slurm_fit.SINFO_FORMAT): a held 10-task array (1_*), a job asking 8 of 4 nodes (2), an array
throttled to 2 at a time (4_*). Lines from other versions' formats are marked where used.
"""

from __future__ import annotations

import stat
from pathlib import Path

SINFO_2205 = """normal*|4|2|3000|gpu:2|infinite|1-infinite|node[1-4]
urgent|4|2|3000|gpu:2|infinite|1-infinite|node[1-4]
"""

SQUEUE_2205 = """2|PENDING|PartitionNodeLimit|normal
1_0|PENDING|JobHeldUser|normal
1_1|PENDING|JobHeldUser|normal
1_2|PENDING|JobHeldUser|normal
1_3|PENDING|JobHeldUser|normal
1_4|PENDING|JobHeldUser|normal
1_5|PENDING|JobHeldUser|normal
1_6|PENDING|JobHeldUser|normal
1_7|PENDING|JobHeldUser|normal
1_8|PENDING|JobHeldUser|normal
1_9|PENDING|JobHeldUser|normal
4_2|RUNNING|None|normal
4_3|RUNNING|None|normal
"""

SACCT_2205 = """2|PENDING|0:0|PartitionNodeLimit
1_[0-9]|PENDING|0:0|JobHeldUser
4_0|COMPLETED|0:0|None
4_1|COMPLETED|0:0|None
4_3|RUNNING|0:0|JobArrayTaskLimit
"""

# After `scontrol release 1_3` and `scancel 1 2`: the released task has its own record and
# stays in the range's record too.
SACCT_2205_CANCELLED = """2|CANCELLED by 0|0:0|PartitionNodeLimit
1_3|CANCELLED by 0|0:0|JobHeldUser
1_[0-9]|CANCELLED by 0|0:0|JobHeldUser
4_0|COMPLETED|0:0|None
4_1|COMPLETED|0:0|None
4_2|COMPLETED|0:0|JobArrayTaskLimit
4_3|COMPLETED|0:0|JobArrayTaskLimit
"""

SBATCH_CPUS = ("sbatch: error: CPU count per node can not be satisfied\n"
               "sbatch: error: Batch job submission failed: Requested node configuration is "
               "not available")
SBATCH_MEMORY = ("sbatch: error: Memory specification can not be satisfied\n"
                 "sbatch: error: Batch job submission failed: Requested node configuration "
                 "is not available")
SBATCH_NODE_CONFIG = ("sbatch: error: Batch job submission failed: Requested node "
                      "configuration is not available")
SBATCH_PARTITION = ("sbatch: error: invalid partition specified: gpu\n"
                    "sbatch: error: Batch job submission failed: Invalid partition name "
                    "specified")
SBATCH_FEATURE = "sbatch: error: Batch job submission failed: Invalid feature specification"
SBATCH_NODE_NAME = "sbatch: error: Batch job submission failed: Invalid node name specified"
SBATCH_OPTION = ("sbatch: unrecognized option '--foo=1'\n"
                 "Try \"sbatch --help\" for more information")


def fake_slurm(folder: Path, outputs: dict[str, str], rc: dict[str, int] | None = None
               ) -> tuple[Path, Path]:
    """Commands named in ``outputs`` (sinfo, squeue, sacct, scancel, scontrol ...) that print
    their text and append their argv to a log; returns (bin folder, log)."""
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "calls.log"
    for name, text in outputs.items():
        data = folder / f"{name}.out"
        data.write_text(text)
        path = folder / name
        code = (rc or {}).get(name, 0)
        path.write_text(f"#!/bin/sh\necho \"{name} $*\" >> {log}\n/bin/cat {data}\nexit {code}\n")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return folder, log


def calls(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []
