"""Every task of a step that ``submit`` started inside an allocation (hpc_ddp/launch/step.py):
``srun ... python -m hpc_ddp.rank.main.step`` runs the pickled task named in its environment
(the same callable a submitit job runs)."""

from __future__ import annotations

import os
import pickle
import sys

from hpc_ddp.rank.contract import TASK_ENV


def main() -> int:
    path = os.environ.pop(TASK_ENV, "")
    if not path:
        print(f"error: {TASK_ENV} is not set: this module runs the tasks of a step that "
              "`python -m hpc_ddp.submit` started; run that instead.", file=sys.stderr)
        return 2
    with open(path, "rb") as handle:
        task = pickle.load(handle)  # written by this user's submit, beside the run's files
    task()
    return 0


if __name__ == "__main__":
    sys.exit(main())
