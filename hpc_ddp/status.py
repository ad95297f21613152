"""``python -m hpc_ddp.status``: the command (hpc_ddp/watch/status.py does the work)."""

from __future__ import annotations

import sys

if __name__ == "__main__":
    from hpc_ddp.watch.status import main  # deferred: only when run as the command

    sys.exit(main())
