"""A failed run's errors, each said once: the same failure from many ranks as one entry with
its ranks and hosts, the first rank to fail marked (docs/observability.md).

Each failed rank leaves ``logs/rank<N>.error`` ("rank N on host: message", a blank line, the
traceback). Two ranks failed the same way when their messages agree once the numbers in them
and each rank's own host name are set aside (a rank's own number, a PID, a port, "on node
node7"): a script that raised on all 1,000 ranks
is one entry, "ranks 0-999 of 1000 on node[001-125]: ...", not 1,000 copies. The files are
read once, when a run has ended; never while it is followed.
"""

from __future__ import annotations

import re
import shlex
import time
from dataclasses import dataclass

from hpc_ddp import hostlist
from hpc_ddp.rank.join.tracebacks import FULL_TRACEBACK_PEER, LOCAL_MARK
from hpc_ddp.ranklines import ranges
from hpc_ddp.rundir import RunDir, read_json

_HEAD = re.compile(r"rank (\d+) on (\S+?): ")
_NUMBER = re.compile(r"\d+")
# The lines a failure entry shows of its message (a state-dict mismatch names keys below).
MAX_LINES = 12


@dataclass(frozen=True)
class Failure:
    """One rank's failure: who, where, what (its error file's first paragraph), when."""

    rank: int
    host: str
    message: str
    when: float
    # The program's traceback (its frames, not those it was called through; "" for a
    # refusal or diagnosis whose message says it all).
    traceback: str = ""
    # The file had the program's traceback looked for (error files since 2026-12-04):
    # without one, a refusal's message is complete (no log lines shown after it)...
    sorted_out: bool = False
    # ... unless the failure is another rank's: this rank's last log lines say what it did.
    peer: bool = False

    @property
    def kind(self) -> str:
        """What two ranks that failed the same way share."""
        return _NUMBER.sub("#", self.about("<host>"))

    def about(self, hosts: str) -> str:
        """The message with this rank's own host name as ``hosts`` (a group's hosts)."""
        if self.host in ("", "?"):
            return self.message
        return re.sub(rf"(?<![\w.-]){re.escape(self.host)}(?![\w-])", hosts, self.message)


@dataclass(frozen=True)
class Group:
    """Ranks that failed the same way; ``failures`` in the order they failed."""

    failures: tuple[Failure, ...]

    @property
    def first(self) -> Failure:
        return self.failures[0]

    @property
    def ranks(self) -> list[int]:
        return sorted(f.rank for f in self.failures)

    def head(self, world_size: int | None) -> str:
        """"ranks 0-3 of 4 on node[1-4]: <message>" (a single rank: "rank 2 on node3")."""
        ranks = self.ranks
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranges(ranks)}"
        of = f" of {world_size}" if world_size and len(ranks) > 1 else ""
        hosts = _hosts([f.host for f in self.failures])
        lines = self.first.about(hosts).splitlines()
        lines = lines[:MAX_LINES] + (["..."] if len(lines) > MAX_LINES else [])
        return f"{who}{of} on {hosts}: " + "\n".join(lines)


def read(run: RunDir, ranks: list[int]) -> list[Failure]:
    """The failures of ``ranks`` (those with an error file), in the order they were written."""
    found = []
    for rank in ranks:
        path = run.rank_error(rank)
        try:
            text = path.read_text(errors="replace")
            when = path.stat().st_mtime
        except OSError:
            continue
        first, _, rest = text.partition("\n\n")
        first = first.replace(f"{LOCAL_MARK} ", "")
        head = _HEAD.match(first)
        host = head[2] if head else "?"
        message = first[head.end():] if head else first
        trace = rest.split(FULL_PREFIX, 1)[0] if rest.startswith(TRACEBACK) else ""
        full = rest.startswith(FULL_PREFIX.strip()) or FULL_PREFIX in rest
        found.append(Failure(rank, host, message, when, trace, full, FULL_TRACEBACK_PEER in rest))
    return _one_per_rank(sorted(found, key=lambda f: (f.when, f.rank)))


def _one_per_rank(found: list[Failure]) -> list[Failure]:
    """Each failure under the rank it is about: a rank that reports another's ("rank 0 on
    node1: rank 1 on node2: KeyError ...", its run stopped by that failure) adds nothing
    where that rank has its own error file, and stands for it where it has none (a rank
    that hung or died silently)."""
    own = {f.rank for f in found if not _HEAD.match(f.message)}
    kept: list[Failure] = []
    about: set[int] = set()
    for failure in found:
        head = _HEAD.match(failure.message)
        if head is None:
            kept.append(failure)
            continue
        subject = int(head[1])
        if subject in own or subject in about:
            continue
        about.add(subject)
        kept.append(Failure(subject, head[2], failure.message[head.end():], failure.when,
                            failure.traceback, failure.sorted_out, True))
    return kept


def grouped(failures: list[Failure]) -> list[Group]:
    """The failures by kind, the group of the first failure first."""
    groups: dict[str, list[Failure]] = {}
    for failure in failures:  # in time order: each group's first is its earliest
        groups.setdefault(failure.kind, []).append(failure)
    return [Group(tuple(g)) for g in groups.values()]


def report(run: RunDir, ranks: list[int], log_lines: int = 15) -> list[str]:
    """The lines of a failure report: each kind of failure once, with the last lines of the
    first failing rank's log where the message does not carry them already."""
    from hpc_ddp.rank.join.ranklog import tail  # deferred (start-up): rank.join.ranklog

    groups = grouped(read(run, ranks))
    root = recorded_root(run)
    if root is not None:  # the supervisors' decision, as events.jsonl and status say it
        groups.sort(key=lambda g: root[0] not in g.ranks)
    world = world_size(run)
    lines: list[str] = []
    if len(groups) > 1 or (groups and len(groups[0].ranks) > 1):
        first = groups[0].first
        who, host, when = root if root is not None and root[0] in groups[0].ranks else (
            first.rank, first.host, first.when)
        lines.append(f"first to fail: rank {who} on {host} (at "
                     f"{time.strftime('%H:%M:%S', time.localtime(when))})")
    for group in groups:
        lines.append(group.head(world))
        shown = next((f.rank for f in group.failures if run.rank_log(f.rank).exists()), None)
        if shown is None:  # a rank that never started Python has no log
            continue
        trace = group.first.traceback
        if trace:  # the program's frames; its last line is the message above
            lines += trace.splitlines()[:-1] if trace.endswith(group.first.message) else [trace]
        elif "its last lines:" not in group.first.message and (
                group.first.peer or not group.first.sorted_out):
            lines += [f"last lines of {run.rank_log(shown)}:", tail(run.rank_log(shown),
                                                                   log_lines)]
        lines.append(f"all of rank {shown}'s lines: python -m hpc_ddp.logs "
                     f"{shlex.quote(str(run.root))} --rank {shown}")
    return lines


# An error file's blocks (rank/join/joined.py): the message, the program's traceback when
# there is one, then the whole chain under a FULL_TRACEBACK header (either form).
TRACEBACK = "Traceback (most recent call last):"
FULL_PREFIX = "\n\nFull traceback ("


def recorded_root(run: RunDir) -> tuple[int, str, float] | None:
    """The first failing rank of the run's last recorded failure (events.jsonl, written by
    the rank that decided: the supervisors' root cause), its host and when it failed."""
    from hpc_ddp import events  # deferred (start-up): events

    last = next((e for e in reversed(events.read(run.root)) if e.get("kind") == events.FAILURE),
                None)
    if last is None or not isinstance(last.get("rank"), int):
        return None
    return (int(last["rank"]), str(last.get("host") or "?"),
            float(last.get("failed_at") or last.get("time") or 0.0))


def world_size(run: RunDir) -> int | None:
    """The run's number of ranks (rank 0's record; None before it is written)."""
    record = read_json(run.ranks / "rank0.json")
    size = record.get("world_size") if isinstance(record, dict) else None
    return size if isinstance(size, int) else None


def _hosts(hosts: list[str]) -> str:
    try:
        return hostlist.collect(hosts)
    except Exception:  # a name the hostlist library cannot fold: the names as they are
        return ",".join(sorted(set(hosts)))


def first_failure(run: RunDir) -> list[dict[str, object]]:
    """The first rank to fail by its error file, as events.recovery's failure records (for a
    run that failed before it could record one: while joining, a refusal)."""
    found = read(run, sorted(int(p.stem[4:]) for p in run.logs.glob("rank*.error")
                             if p.stem[4:].isdigit()))
    return [{"rank": f.rank, "host": f.host, "cause": f.message.splitlines()[0]}
            for f in found[:1]]
