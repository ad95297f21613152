"""Fetch a dataset on a machine with internet (a login node), once, before training.

    python -m hpc_ddp.data download cifar10 root=/shared/datasets
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

USAGE = "usage: python -m hpc_ddp.data download cifar10 root=/path/to/datasets"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    roots = [a.partition("=")[2] for a in args if a.startswith("root=")]
    rest = [a for a in args if not a.startswith("root=")]
    if rest != ["download", "cifar10"] or len(roots) != 1 or not roots[0]:
        print(USAGE, file=sys.stderr)
        return 2
    from hpc_ddp.data.cifar10 import download

    try:
        path = download(roots[0])
    except OSError as exc:  # URLError is an OSError: no internet, proxy, DNS
        print(
            f"error: could not download CIFAR-10 into {roots[0]}: {exc}. This needs internet "
            "access (run it on a login node), or copy cifar-10-batches-py/ there by hand.",
            file=sys.stderr,
        )
        return 1
    print(f"CIFAR-10 is in {path}; train with data=cifar10 data.root={path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
