"""``python -m hpc_ddp.doctor [options] [key=value ...]``: see hpc_ddp/doctor/__init__.py."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from hpc_ddp import doctor
from hpc_ddp.doctor import run_doctor
from hpc_ddp.doctor.job import add_job_arguments, check_timeout, prepare
from hpc_ddp.doctor.probe import DoctorOptions
from hpc_ddp.errors import USAGE_EXIT_CODE, UserError


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hpc_ddp.doctor", description=doctor.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=float, default=32.0,
                   help="all-reduce message size in MiB (default 32)")
    p.add_argument("--iters", type=int, default=5, help="timed all-reduces (default 5)")
    p.add_argument("--min-busbw", type=float, default=None, metavar="GBPS",
                   help="fail when the all-reduce bus bandwidth is below this (GB/s)")
    add_job_arguments(p)
    return p


def main(argv: Sequence[str] | None = None, out: TextIO = sys.stdout) -> int:
    args = parser().parse_intermixed_args(sys.argv[1:] if argv is None else argv)
    try:
        if not args.size_mib > 0 or args.iters < 1:  # (nan is not > 0)
            raise UserError("--size-mib/--iters", f"{args.size_mib}/{args.iters}",
                            "must be positive.", "e.g. --size-mib 8 --iters 5.")
        check_timeout(args.timeout_s)
        cfg, run = prepare(args.overrides, "doctor", os.environ, Path.cwd())
        options = DoctorOptions(size_mib=args.size_mib, iters=args.iters,
                                min_busbw_gbps=args.min_busbw)
        report = run_doctor(cfg, run, options, out, args.timeout_s)
    except UserError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return USAGE_EXIT_CODE
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
