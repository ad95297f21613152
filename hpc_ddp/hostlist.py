"""Slurm hostlists ("node[01-04],gpu7") expanded by python-hostlist, the reference parser.

A regex gets these wrong (Lightning returned ``rack1`` for ``rack[1-2]-node[01-02]``); the
library takes the cartesian product of bracket groups, keeps zero padding and refuses bad
syntax. tests/cluster checks it against ``scontrol show hostnames``.
"""

from __future__ import annotations


def expand(nodelist: str) -> list[str]:
    """All host names of ``nodelist`` in Slurm's order; ValueError on malformed input."""
    import hostlist as _hostlist  # deferred: hostlist

    try:
        hosts: list[str] = _hostlist.expand_hostlist(nodelist)
    except _hostlist.BadHostlist as exc:
        raise ValueError(f"malformed Slurm hostlist {nodelist!r}: {exc}") from None
    if not hosts:
        raise ValueError(f"Slurm hostlist {nodelist!r} names no host")
    return hosts


def collect(hosts: list[str]) -> str:
    """``hosts`` as one Slurm hostlist ("node[1-2,4]"): the inverse of :func:`expand`."""
    import hostlist as _hostlist  # deferred: hostlist

    return str(_hostlist.collect_hostlist(sorted(set(hosts))))


def first_host(nodelist: str) -> str:
    """The first host of ``nodelist``: where Slurm places rank 0, our rendezvous master."""
    return expand(nodelist)[0]


def tasks_per_node(spec: str) -> list[int]:
    """Expand SLURM_TASKS_PER_NODE ("2(x3),1") to one count per node: [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in spec.split(","):
        count, _, repeat = part.partition("(x")
        try:
            counts.extend([int(count)] * (int(repeat.rstrip(")")) if repeat else 1))
        except ValueError:
            raise ValueError(f"malformed SLURM_TASKS_PER_NODE {spec!r}") from None
    return counts
