"""Every rank's output in one view: ``python -m hpc_ddp.logs <run_dir | sweep_dir>``.

    python -m hpc_ddp.logs outputs/try1                    # every rank, merged in time order
    python -m hpc_ddp.logs outputs/try1 --rank 3           # one rank (reads one file)
    python -m hpc_ddp.logs outputs/try1 --ranks 0-7,12     # a few
    python -m hpc_ddp.logs outputs/try1 --grep 'Error|nan' # the lines that match (a regex)
    python -m hpc_ddp.logs outputs/try1 --since 10m        # or --since 14:30, '2026-11-30 14:30'
    python -m hpc_ddp.logs outputs/try1 --tail 50          # the last 50 lines
    python -m hpc_ddp.logs outputs/try1 --follow           # new lines as they come, to the end
    python -m hpc_ddp.logs multirun/2026-11-30_10-00-00 --point 3

Each line: its time, rank and host, then OUT or ERR (the program's stdout and stderr) or a
level (hpc_ddp's own lines). A line ``--- attempt ...`` marks where a start of the ranks
begins (a requeue, a restart in place, a resume). Only the ranks asked for are read
(``logs/rank<N>.log``, docs/observability.md); following every rank of a large run reads
256 files a look in turn, so each one every few seconds.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import re
import socket
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from hpc_ddp import ranklines
from hpc_ddp.errors import USAGE_EXIT_CODE, UserError
from hpc_ddp.rundir import RunDir, read_json

# Seconds between two looks at the files when following, and at the job's state.
POLL_S = 0.5
STATE_EVERY_S = 2.0
# Rank files read at most per look when following (see show()).
FOLLOW_BATCH = 256
# With --tail N (and --follow's first lines): about this much of each file's end is read, or
# N KiB if more (a line of more than 1 KiB on average may then be left out).
TAIL_BYTES = 64 * 1024
# The attempt of lines read from a file's end, whose ATTEMPT line lies before them.
EARLIER = "(earlier)"


@dataclass(frozen=True)
class Shown:
    """A line to show: the line, and the attempt it belongs to (its ATTEMPT line's text:
    the same on every rank of one start)."""

    line: ranklines.Line
    attempt: str
    began: str = ""  # its ATTEMPT line's time on this rank ("" when that line was not read)


@dataclass
class RankFile:
    """A rank's log being read: where reading stopped, the attempt and line it stopped in."""

    path: Path
    offset: int = 0
    attempt: str = ""
    began: str = ""
    last: ranklines.Line | None = None
    partial: bytes = field(default=b"", repr=False)
    _cut: bool = field(default=False, repr=False)
    _keep: int | None = field(default=None, repr=False)

    def skip_to_tail(self, lines: int, size: int) -> None:
        """The first read takes only the last ``lines`` lines, from about the last ``size``
        bytes: the last lines of thousands of files, not every line of each."""
        self._keep = lines
        try:
            length = self.path.stat().st_size
        except OSError:
            return
        if length > size:
            self.offset, self.attempt, self._cut = length - size, EARLIER, True

    def read_new(self) -> list[Shown]:
        """The complete lines written since the last call (all of them the first time)."""
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self.offset)
                data = handle.read()
        except OSError:
            return []
        self.offset += len(data)
        if self._cut:  # began mid-line (skip_to_tail): from the next whole line
            self._cut = False
            data = data[data.find(b"\n") + 1:]
        data = self.partial + data
        cut = data.rfind(b"\n") + 1
        self.partial, data = data[cut:], data[:cut]
        found = []
        raws = data.decode(errors="replace").splitlines()
        if self._keep is not None:
            raws = self._last_lines(raws, self._keep)
            self._keep = None
        for raw in raws:
            parsed = ranklines.parse(raw)
            if parsed is None:  # a message's continuation, with the line before it
                if self.last is None:
                    continue
                parsed = self.last._replace(text=raw)
            self.last = parsed
            if parsed.kind == ranklines.ATTEMPT:
                self.attempt, self.began = parsed.text, parsed.time
                continue
            found.append(Shown(parsed, self.attempt, self.began))
        return found


    def _last_lines(self, raws: list[str], keep: int) -> list[str]:
        """The last ``keep`` lines of ``raws``; the attempt they belong to from the last
        ATTEMPT line before them (found as text: only that one is parsed)."""
        start = max(len(raws) - keep, 0)
        while start > 0 and ranklines.parse(raws[start]) is None:
            start -= 1  # a message's continuation: from the line it continues
        marker = f" {ranklines.ATTEMPT} "
        for raw in reversed(raws[:start]):
            if marker in raw:
                parsed = ranklines.parse(raw)
                if parsed is not None and parsed.kind == ranklines.ATTEMPT:
                    self.attempt, self.began = parsed.text, parsed.time
                    break
        return raws[start:]


def parse_ranks(text: str) -> list[int]:
    """"0-7,12" -> [0, ..., 7, 12]; ValueError for anything else."""
    ranks: set[int] = set()
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        low, high = int(first), int(last or first)
        if low < 0 or high < low:
            raise ValueError(part)
        ranks.update(range(low, high + 1))
    return sorted(ranks)


def parse_since(text: str, now: _dt.datetime | None = None) -> str:
    """``10m``, ``2h``, ``30s``, ``1d`` ago, ``14:30`` (today), or ``2026-11-30 14:30``, as
    a line's time text to compare with; ValueError otherwise."""
    now = now or _dt.datetime.now()
    found = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([smhd])", text.strip())
    if found:
        seconds = float(found[1]) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[found[2]]
        when = now - _dt.timedelta(seconds=seconds)
    else:
        for fmt in ("%H:%M", "%H:%M:%S", "%Y-%m-%d %H:%M", "%Y-%m-%d %H:%M:%S", "%Y-%m-%d"):
            try:
                parsed = _dt.datetime.strptime(text.strip(), fmt)
            except ValueError:
                continue
            when = parsed if fmt.startswith("%Y") else now.replace(
                hour=parsed.hour, minute=parsed.minute, second=parsed.second, microsecond=0)
            break
        else:
            raise ValueError(text)
    return when.strftime("%Y-%m-%d %H:%M:%S.000")


def rank_files(logs: Path, ranks: Sequence[int] | None) -> list[Path]:
    """The logs of ``ranks`` (every rank's: one listing of the folder, no file opened)."""
    if ranks is not None:
        return [logs / f"rank{r}.log" for r in ranks]
    try:
        names = [e.name for e in os.scandir(logs)]
    except OSError:
        return []
    found = [(int(n[4:-4]), n) for n in names
             if n.startswith("rank") and n.endswith(".log") and n[4:-4].isdigit()]
    return [logs / n for _, n in sorted(found)]


def selected(lines: Iterable[Shown], since: str | None, grep: re.Pattern[str] | None
             ) -> list[Shown]:
    return [s for s in lines if (since is None or s.line.time >= since)
            and (grep is None or grep.search(s.line.text))]


def merged(files: Sequence[RankFile], since: str | None = None,
           grep: re.Pattern[str] | None = None) -> list[Shown]:
    """The new lines of every file, in time order (ties: rank order)."""
    found: list[Shown] = []
    for f in files:
        found += selected(f.read_new(), since, grep)
    found.sort(key=lambda s: (s.line.time, s.line.rank))
    return found


class Printer:
    """Prints lines, with a marker each time the attempt changes."""

    def __init__(self, out: TextIO, raw: bool = False) -> None:
        self.out, self.raw = out, raw
        self.attempt: str | None = None

    def show(self, lines: Iterable[Shown]) -> None:
        text = []
        for s in lines:
            if s.attempt != self.attempt:
                self.attempt = s.attempt
                text.append(attempt_marker(s.attempt, s.began or s.line.time))
            ln = s.line
            text.append(f"{ln.time[11:]} [rank {ln.rank} {ln.host}] {ln.kind} {ln.text}")
        if text:
            shown = "\n".join(text)
            print(shown if self.raw else ranklines.for_terminal(shown), file=self.out,
                  flush=True)


def attempt_marker(attempt: str, when: str) -> str:
    """"--- attempt: job 42.0, restart 1, generation 0 (2026-11-30 10:00:01) ---": the
    attempt the next lines belong to, and ``when``: when it began (its ATTEMPT line's time),
    else the first line's."""
    if attempt == EARLIER:
        return f"--- the attempt that began before these lines ({when[:19]}) ---"
    if not attempt:
        return f"--- before the first attempt line ({when[:19]}) ---"
    fields = ranklines.attempt_of(attempt)
    return (f"--- attempt: job {fields.get('job', '?')}, restart {fields.get('restart', '?')}, "
            f"generation {fields.get('generation', '?')} ({when[:19]}) ---")


def run_dir_of(path: Path, point: int | None) -> Path:
    """The run dir to read: ``path``, or a sweep's point ``point``; UserError otherwise."""
    # deferred: the typed schemas (sweep.launch)
    from hpc_ddp.sweep.launch import read_manifest

    if not path.is_dir():
        raise UserError("path", str(path), "is not a folder." if path.exists() else
                        "does not exist.", "pass a run dir (submit prints it) or a sweep dir "
                        "with --point N.")
    manifest = read_manifest(path)
    if manifest is not None:
        points = manifest["points"]
        if point is None or not 0 <= point < len(points):
            raise UserError("--point", "(none)" if point is None else point,
                            f"{path} is a sweep of {len(points)} points.",
                            f"pass --point N with N from 0 to {len(points) - 1}.")
        return Path(points[point]["run_dir"])
    if point is not None:
        raise UserError("--point", point, f"{path} is a run dir, not a sweep.",
                        "leave --point out.")
    if not (path / "logs").is_dir() and not (path / "job.json").is_file():
        raise UserError("path", str(path), "holds no rank logs (no logs/ folder).",
                        "pass the run dir submit printed, or wait until the ranks start.")
    return path


def main(argv: Sequence[str] | None = None, out: TextIO = sys.stdout) -> int:
    from hpc_ddp.remote.handle import forwarded  # deferred (start-up): remote.handle

    if (code := forwarded("logs", sys.argv[1:] if argv is None else argv, out)) is not None:
        return code  # a remote run's local handle: run where the run is (docs/remote.md)
    parser = argparse.ArgumentParser(prog="python -m hpc_ddp.logs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", type=Path, help="a run dir, or a sweep dir with --point")
    parser.add_argument("--rank", type=int, help="one rank")
    parser.add_argument("--ranks", help="ranks such as 0-7,12")
    parser.add_argument("--grep", help="only the lines matching this regular expression")
    parser.add_argument("--since", help="only lines since: 10m, 2h, 14:30, '2026-11-30 14:30'")
    parser.add_argument("--tail", type=int, help="only the last N lines")
    parser.add_argument("--follow", "-f", action="store_true",
                        help="print new lines as they come, until the run ends")
    parser.add_argument("--point", type=int, help="a sweep's point")
    parser.add_argument("--raw", action="store_true",
                        help="print control characters as written (escape sequences act on "
                        "your terminal); without it they are shown as \\xNN")
    args = parser.parse_args(argv)
    try:
        options = checked(args)
        run_dir = run_dir_of(args.path.absolute(), args.point)
        return show(RunDir(run_dir), *options, tail=args.tail, follow=args.follow, out=out,
                    raw=args.raw)
    except UserError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return USAGE_EXIT_CODE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def checked(args: argparse.Namespace) -> tuple[list[int] | None, str | None,
                                                re.Pattern[str] | None]:
    """(ranks, since, grep) from the options; UserError naming a bad one."""
    if args.rank is not None and args.ranks is not None:
        raise UserError("--rank", args.rank, "and --ranks both given.", "give one of them.")
    ranks = None
    if args.rank is not None:
        if args.rank < 0:
            raise UserError("--rank", args.rank, "is not a rank.", "give 0 or more.")
        ranks = [args.rank]
    elif args.ranks is not None:
        try:
            ranks = parse_ranks(args.ranks)
        except ValueError:
            raise UserError("--ranks", args.ranks, "is not a list of ranks.",
                            "give ranks and ranges such as 0-7,12.") from None
    since = None
    if args.since is not None:
        try:
            since = parse_since(args.since)
        except ValueError:
            raise UserError("--since", args.since, "is not a time.", "give 10m, 2h, 14:30 or "
                            "'2026-11-30 14:30'.") from None
    grep = None
    if args.grep is not None:
        try:
            grep = re.compile(args.grep)
        except re.error as exc:
            raise UserError("--grep", args.grep, f"is not a regular expression ({exc}).",
                            "escape special characters, e.g. 'loss \\(eval\\)'.") from None
    if args.tail is not None and args.tail < 0:
        raise UserError("--tail", args.tail, "is negative.", "give a number of lines.")
    return ranks, since, grep


def _check_ranks(run: RunDir, ranks: list[int] | None) -> None:
    """UserError for a rank the run does not have (rank 0's record gives the world size;
    before it is written nothing is refused)."""
    record = read_json(run.ranks / "rank0.json")
    world = record.get("world_size") if isinstance(record, dict) else None
    if ranks is None or not isinstance(world, int):
        return
    beyond = [r for r in ranks if r >= world]
    if beyond:
        one = len(ranks) == 1
        key, value = ("--rank", beyond[0]) if one else ("--ranks", ranklines.ranges(ranks))
        raise UserError(key, value, f"the run has {world} rank{'s' if world > 1 else ''} "
                        f"(0-{world - 1}).", f"give ranks below {world}.")


def show(run: RunDir, ranks: list[int] | None, since: str | None,
         grep: re.Pattern[str] | None, tail: int | None = None, follow: bool = False,
         out: TextIO = sys.stdout, raw: bool = False) -> int:
    """Print the lines (the last ``tail``), then with ``follow`` the new ones until the run
    has ended; control characters shown as ``\\xNN`` unless ``raw``."""
    _check_ranks(run, ranks)
    files = [RankFile(p) for p in rank_files(run.logs, ranks)]
    printer = Printer(out, raw)
    if follow and tail is None:
        tail = 10
    if tail is not None and since is None and grep is None:
        for f in files:  # the last lines of all lie in the last lines of each
            f.skip_to_tail(tail, max(TAIL_BYTES, tail * 1024))
    lines = merged(files, since, grep)
    printer.show(lines[-tail:] if tail else [] if tail == 0 else lines)
    if ranks is not None:
        missing = [f.path.name for f in files if not f.path.exists()]
        if missing and not follow:
            print(f"(no log yet: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''})",
                  file=sys.stderr)
    if not follow:
        return 0
    ended = _Ended(run.root)
    known = {f.path for f in files}
    turn, listed = 0, time.monotonic()
    while True:
        time.sleep(POLL_S)
        finished = ended()
        if ranks is None and (finished or time.monotonic() - listed > STATE_EVERY_S):
            listed = time.monotonic()
            for path in rank_files(run.logs, None):  # ranks that started since
                if path not in known:
                    known.add(path)
                    files.append(RankFile(path))
        # At most FOLLOW_BATCH files a look, in turn (thousands of ranks: each one every few
        # seconds, never every file twice a second); all of them once more at the end.
        batch = files if finished or len(files) <= FOLLOW_BATCH else \
            (files + files)[turn:turn + FOLLOW_BATCH]
        turn = (turn + FOLLOW_BATCH) % max(len(files), 1)
        printer.show(merged(batch, since, grep))
        if finished:
            return 0


class _Ended:
    """Whether the run's job has ended (one Slurm call every STATE_EVERY_S at most)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.at = 0.0
        self.answer = False

    def __call__(self) -> bool:
        now = time.monotonic()
        if now - self.at < STATE_EVERY_S:
            return self.answer
        self.at = now
        self.answer = ended(self.root)
        return self.answer


def ended(root: Path) -> bool:
    """The run's job has ended: its job.json's job (or, for a jobs/train.sbatch run, the
    Slurm job in owner.json); False while nothing says so."""
    # deferred: the typed schemas (api), rank.join.owner
    from hpc_ddp.api import JOB_FILE, Run
    from hpc_ddp.rank.join import owner

    job = read_json(root / JOB_FILE)
    if isinstance(job, dict) and job.get("job_id"):
        return Run(root, job).done()
    claim: Any = read_json(root / "owner.json")
    if isinstance(claim, dict):
        return owner.alive(claim, socket.gethostname(), os.environ) is False
    return False


if __name__ == "__main__":
    sys.exit(main())
