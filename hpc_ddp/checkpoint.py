"""A run's checkpoint as one plain file, for inference or sharing:
``python -m hpc_ddp.checkpoint export RUN [--step N] OUT``.

    python -m hpc_ddp.checkpoint export outputs/try1 model.pt              # the latest
    python -m hpc_ddp.checkpoint export outputs/try1 --step 200 model.pt
    python -m hpc_ddp.checkpoint export outputs/try1 model.safetensors     # tensors only
    python -m hpc_ddp.checkpoint export outputs/try1 model.pt --force      # replace model.pt

Either format a run writes (one file from rank 0, or a sharded DCP folder written by every
rank: docs/fault-tolerance.md#sharded-checkpoints-dcp) comes out as one state dict with every
tensor whole, on the CPU: the loop's own keys (``model``, ``optimizer``, ...) and hpc_ddp's
record (``hpc_ddp``: step, world size, restarts). It is read as data only, from files only
this user could have written (docs/security.md), on this machine, without a process group.
``.safetensors`` (when the safetensors package is installed) holds the tensors alone, each
under its dotted name (``model.encoder.0.weight``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hpc_ddp.errors import USAGE_EXIT_CODE, UserError
from hpc_ddp.owned import Untrusted
from hpc_ddp.rundir import RunDir, write_atomic


def chosen(run: RunDir, step: int | None) -> Path:
    """The checkpoint to export: ``latest``, or the newest one of ``step``."""
    from hpc_ddp.rank.services import checkpoint  # deferred (start-up): checkpoint

    folder = run.checkpoints
    if not folder.is_dir():
        raise UserError("run", str(run.root), "has no checkpoints folder.",
                        "pass a run dir (submit prints it) of a run that saved a checkpoint.")
    if step is None:
        latest = checkpoint.latest_path(folder)
        if latest is None:
            raise UserError("run", str(run.root), "has no complete checkpoint yet.",
                            "export once the run saved one (it names it in checkpoints/latest).")
        return latest
    kept = [p for p in checkpoint.entries(folder) if checkpoint.step_of(p) == step]
    if not kept:
        steps = sorted({s for p in checkpoint.entries(folder)
                        if (s := checkpoint.step_of(p)) is not None})
        raise UserError("--step", step, "is not a kept checkpoint of the run.",
                        f"pick one of {', '.join(map(str, steps)) or 'none'}.")
    return kept[-1]


def export(run_dir: Path, out: Path, step: int | None = None, force: bool = False) -> Path:
    """Write the checkpoint (see the module docstring) to ``out``; returns the file read. An
    existing ``out`` is replaced only with ``force`` (it may be an earlier export in use)."""
    if out.suffix == ".safetensors":
        try:
            import safetensors.torch  # noqa: F401  optional: safetensors
        except ImportError:
            raise UserError("OUT", str(out), "needs the safetensors package, which is not "
                            "installed.", "pip install safetensors, or write a .pt file.") from None
    if not out.parent.is_dir():
        raise UserError("OUT", str(out), "is in a folder that does not exist.",
                        f"create {out.parent} first.")
    run = RunDir(run_dir.absolute())
    path = chosen(run, step)
    if out.exists() and not force:
        raise UserError("OUT", str(out), "exists already.", "pass --force to replace it, or "
                        "name another file.")
    from hpc_ddp.rank.services import checkpoint  # deferred: torch (checkpoint)

    try:
        state = checkpoint.read_data(path, run.root)
    except Untrusted as exc:
        raise UserError("run", str(run.root), str(exc), "") from None
    _write(out, state)
    return path


def _write(out: Path, state: dict[str, Any]) -> None:
    # deferred: torch, tensor_tree
    import torch

    from hpc_ddp.rank.services import tensor_tree

    if out.suffix == ".safetensors":
        from safetensors.torch import save  # optional: safetensors

        tensors = {name: t.detach().contiguous()
                   for name, t in tensor_tree.split(state)[1].items()}
        data = save(tensors)
        write_atomic(out, lambda handle: handle.write(data))
        return
    write_atomic(out, lambda handle: torch.save(state, handle))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpc_ddp.checkpoint", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    exporting = commands.add_parser("export", help="one plain file of a run's checkpoint")
    exporting.add_argument("run", type=Path, help="the run dir")
    exporting.add_argument("out", type=Path, help="the file to write (.pt or .safetensors)")
    exporting.add_argument("--step", type=int, help="the step (default: the latest)")
    exporting.add_argument("--force", action="store_true", help="replace an existing OUT")
    args = parser.parse_args(argv)
    try:
        replaced = args.out.exists()
        path = export(args.run, args.out, args.step, args.force)
    except UserError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return USAGE_EXIT_CODE
    print(f"{'replaced' if replaced else 'wrote'} {args.out} from {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
