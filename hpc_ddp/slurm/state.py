"""Slurm jobs' states: squeue for what the controller holds, sacct for what has ended.

One ``squeue`` and at most one ``sacct`` per look, for one job or a whole sweep: array
tasks are asked for by their array's id, so a 1,000-point sweep in 100 arrays is still two
calls (a status refresh every 5 s must not become ~100 calls a second against slurmctld
and slurmdbd). squeue comes first because its state and pending reason are live (accounting
keeps the reason a job had when it was submitted); sacct answers for jobs squeue no longer
lists, with Slurm's raw text ("CANCELLED by 1000") and the exit code.

submitit's own ``done()`` trusts its result files, which an earlier attempt of a requeued
job leaves behind; following a job that requeues itself needs Slurm's word.

Without accounting (``AccountingStorageType=accounting_storage/none``, Slurm's default; or a
slurmdbd this machine cannot reach) sacct fails: that is found out once per process, said
once in one line, and sacct is not asked again. A job's end then comes from squeue, which
lists an ended job with its end state while the controller keeps it (``MinJobAge``, 300 s by
default: https://slurm.schedmd.com/slurm.conf.html#OPT_MinJobAge); a job squeue no longer
lists has ended (ENDED), and hpc_ddp/watch/ended.py reads how from the run's own records.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from hpc_ddp.slurm.cost import FIELDS, Cost, Record, cost_of

# States after which the job will not run again (REQUEUED, PENDING, RUNNING, PREEMPTED and
# SUSPENDED are not: a requeued or preempted job comes back). https://slurm.schedmd.com/sacct.html#SECTION_JOB-STATE-CODES
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "BOOT_FAIL", "DEADLINE", "ENDED")
# Ours: a job gone from squeue when no accounting can say how it ended (module doc).
ENDED = "ENDED"
_GONE_RAW = "ENDED (no longer in Slurm's queue; no accounting says how it ended)"
# squeue -o: job id (an array task as 123_4, one per line with -r), state, pending reason,
# partition(s). https://slurm.schedmd.com/squeue.html#OPT_format
SQUEUE_FORMAT = "%i|%T|%r|%P"
SACCT_FIELDS = "JobID,State,ExitCode,Reason"


# Slurm's states shown as another: COMPLETING is a job whose processes Slurm is still
# cleaning up, which ends as COMPLETED or FAILED; until then it runs (docs/api.md#states).
FOLDED = {"COMPLETING": "RUNNING"}


def normalise(raw: str) -> str:
    """Slurm's state text as one word scripts can compare: "CANCELLED by 1000" -> CANCELLED,
    "CANCELLED+" (a fixed-width column cut it) -> CANCELLED, COMPLETING -> RUNNING (FOLDED);
    "" stays ""."""
    words = raw.split()
    word = words[0].rstrip("+").upper() if words else ""
    return FOLDED.get(word, word)


@dataclass(frozen=True)
class JobState:
    """``state``: one word (CANCELLED, not "CANCELLED by 0"); ``raw``: Slurm's own text;
    ``reason``: Slurm's pending reason ("" for none), e.g. PartitionNodeLimit; ``partition``:
    where the job waits or runs (squeue's word; "" when only accounting answered)."""

    state: str
    exit_code: str = ""
    reason: str = ""
    raw: str = ""
    partition: str = ""

    @classmethod
    def of(cls, raw: str, exit_code: str = "", reason: str = "",
           partition: str = "") -> JobState:
        reason = reason.strip()
        return cls(normalise(raw), exit_code.strip(), "" if reason == "None" else reason,
                   raw.strip(), partition.strip())

    @property
    def finished(self) -> bool:
        # An empty state (a record sacct has not filled yet) is not an end.
        return normalise(self.state) in TERMINAL


def query(job_id: str, environ: Mapping[str, str] | None = None) -> JobState | None:
    """The job's state now (None while neither squeue nor sacct knows it): one squeue call
    while the controller holds the job, one sacct more on the look that finds it ended."""
    return query_many([job_id], environ).get(job_id)


def query_many(job_ids: Iterable[str], environ: Mapping[str, str] | None = None
               ) -> dict[str, JobState]:
    """The states of all these jobs (array tasks as ``123_4``) in one squeue call and at
    most one sacct call, whatever their number; a job neither knows is left out (ENDED
    when squeue answered and accounting cannot: the module doc)."""
    env = dict(os.environ if environ is None else environ)
    ids = list(dict.fromkeys(str(i) for i in job_ids))
    if not ids:
        return {}
    listed = _ask(squeue_command(_asked(ids)), env)
    live = parse_squeue(listed or "")
    found = {i: live[i] for i in ids if i in live}
    ended = [i for i in ids if i not in found or found[i].finished]
    if ended:
        accounted = parse_sacct(_accounting(sacct_command(_asked(ended)), env) or "")
        for i in ended:
            state = accounted.get(i)
            if state is not None:
                found[i] = state
        _gone(ids, found, listed, env)
    return found


def _gone(ids: Sequence[str], found: dict[str, JobState], listed: str | None,
          env: Mapping[str, str]) -> None:
    """Without accounting, a job squeue (which answered) no longer lists has ended."""
    if listed is not None and accounting_problem(env):
        for i in ids:
            found.setdefault(i, JobState(ENDED, raw=_GONE_RAW))


def _asked(ids: Sequence[str]) -> list[str]:
    """The ids to name on the command line: an array task's array (123_4 -> 123; squeue -r
    and sacct then list every task of it, including the ones that never started)."""
    return list(dict.fromkeys(i.split("_")[0] for i in ids))


def squeue_command(asked: Sequence[str]) -> list[str]:
    # -t all: an ended job too, with its end state, while the controller keeps it (the only
    # word on its end where there is no accounting). https://slurm.schedmd.com/squeue.html#OPT_states
    command = ["squeue", "-h", "-r", "-t", "all", "-j", ",".join(asked), "-o", SQUEUE_FORMAT]
    if len(asked) > 1:
        # With one job id squeue loads that job only; with several it loads the whole queue
        # unless one user is named (slurm_load_job_user): ours. Another user's job is then
        # left to sacct. https://slurm.schedmd.com/squeue.html#OPT_user
        command += ["-u", str(os.getuid())]
    return command


def sacct_command(asked: Sequence[str]) -> list[str]:
    # -X: the job's allocation, not its steps; -P: '|'-separated, never cut to a width. With
    # -j, sacct reports the latest job of each id (a requeued job's current record).
    return ["sacct", "-X", "-n", "-P", "-o", SACCT_FIELDS, "-j", ",".join(asked)]


def parse_squeue(text: str) -> dict[str, JobState]:
    """``squeue -o '%i|%T|%r|%P'`` lines -> {job id: state}."""
    found: dict[str, JobState] = {}
    for line in text.splitlines():
        ids, state, rest = (line.split("|", 2) + ["", ""])[:3]
        reason, _, partition = rest.rpartition("|") if "|" in rest else (rest, "", "")
        for job_id in _members(ids.strip()):
            found[job_id] = JobState.of(state, "", reason, partition)
    return found


def parse_sacct(text: str) -> dict[str, JobState]:
    """``sacct -X -P -o JobID,State,ExitCode,Reason[,Submit,...]`` lines -> {job id: state}.
    An array task that never started (still pending, or cancelled while pending) has no
    record of its own: accounting lists it in a range such as ``123_[4-9]`` or
    ``123_[4-9%2]``. With ``-D`` (every start of a requeued job), the latest start's."""
    ranged: dict[str, JobState] = {}
    own: dict[str, JobState] = {}
    latest: dict[str, str] = {}
    for line in text.splitlines():
        ids, state, code, reason, *more = (line.split("|") + ["", "", ""])[:4 + len(FIELDS)]
        submit = more[0] if more else ""
        for job_id in _members(ids.strip()):
            if "[" not in ids and submit < latest.get(job_id, ""):
                continue  # an earlier start of a requeued job (ISO times sort as text)
            # A task's own record wins over a range that still lists it (seen in 22.05: a
            # task released from a held array keeps its place in the range's record).
            (ranged if "[" in ids else own)[job_id] = JobState.of(state, code, reason)
            if "[" not in ids:
                latest[job_id] = submit
    return {**ranged, **own}


def accounted_command(asked: Sequence[str]) -> list[str]:
    """sacct for states and cost: -D lists every start of a requeued job (its cost is the
    sum); the cost fields (slurm/cost.py) after the state's."""
    return ["sacct", "-X", "-D", "-n", "-P", "-o", f"{SACCT_FIELDS},{','.join(FIELDS)}",
            "-j", ",".join(asked)]


def parse_costs(text: str, now: float | None = None) -> dict[str, Cost]:
    """accounted_command's lines -> {job id: its cost over all its starts}. An array task
    still pending (listed in a range) has waited since the array's submission."""
    records: dict[str, list[Record]] = {}
    ranged: dict[str, Record] = {}
    for line in text.splitlines():
        fields = line.split("|")
        if len(fields) < 4 + len(FIELDS):
            continue
        ids, record = fields[0].strip(), Record.parse(fields[4:4 + len(FIELDS)])
        for job_id in _members(ids):
            if "[" in ids:
                ranged[job_id] = record
            else:
                records.setdefault(job_id, []).append(record)
    for job_id, record in ranged.items():
        records.setdefault(job_id, [record])
    return {job_id: cost_of(found, now) for job_id, found in records.items()}


def costs(job_ids: Iterable[str], environ: Mapping[str, str] | None = None
          ) -> dict[str, Cost]:
    """What these jobs cost (every start of each): one sacct call."""
    env = dict(os.environ if environ is None else environ)
    ids = list(dict.fromkeys(str(i) for i in job_ids))
    found = parse_costs(_accounting(accounted_command(_asked(ids)), env) or "") if ids else {}
    return {i: found[i] for i in ids if i in found}


def query_with_cost(job_ids: Iterable[str], environ: Mapping[str, str] | None = None
                    ) -> tuple[dict[str, JobState], dict[str, Cost]]:
    """:func:`query_many`, and what each job cost so far: one squeue call and one sacct
    call, whatever the number of jobs (a status refresh)."""
    env = dict(os.environ if environ is None else environ)
    ids = list(dict.fromkeys(str(i) for i in job_ids))
    if not ids:
        return {}, {}
    listed = _ask(squeue_command(_asked(ids)), env)
    live = parse_squeue(listed or "")
    text = _accounting(accounted_command(_asked(ids)), env) or ""
    accounted = parse_sacct(text)
    found = {i: live[i] for i in ids if i in live}
    for i in ids:
        if (i not in found or found[i].finished) and i in accounted:
            found[i] = accounted[i]
    _gone(ids, found, listed, env)
    costs = parse_costs(text)
    return found, {i: costs[i] for i in ids if i in costs}


_RANGE = re.compile(r"^(?P<array>\d+)_\[(?P<tasks>[\d,\-:]+)(?:%\d+)?\]$")


def _members(ids: str) -> list[str]:
    """The job ids a record stands for: itself, or every task of an array range."""
    match = _RANGE.match(ids)
    if not match:
        return [ids] if ids else []
    members = []
    for part in match["tasks"].split(","):
        span, _, step = part.partition(":")
        first, _, last = span.partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            continue
        stop = int(last or first)
        members += [f"{match['array']}_{t}" for t in
                    range(int(first), stop + 1, int(step) if step.isdigit() and step != "0"
                          else 1)]
    return members


def _run(cmd: list[str], env: dict[str, str]) -> str:
    return _ask(cmd, env) or ""


def _ask(cmd: list[str], env: dict[str, str]) -> str | None:
    """The command's output; None when it could not answer (not found, failed, timed out)."""
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=30,
                              check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0 and "Invalid job id specified" in done.stderr:
        return ""  # squeue's answer for one job the controller no longer holds
    return done.stdout.strip() if done.returncode == 0 else None


# Found out once per process and Slurm configuration (the module doc): sacct's own words
# when it cannot answer.
_ACCOUNTING: dict[tuple[str, str], str] = {}


def _where(env: Mapping[str, str]) -> tuple[str, str]:
    return env.get("SLURM_CONF", ""), env.get("PATH", "")


def accounting_problem(environ: Mapping[str, str] | None = None) -> str:
    """Why sacct cannot answer here ("" while it can, or before it was asked)."""
    return _ACCOUNTING.get(_where(os.environ if environ is None else environ), "")


def _accounting(cmd: list[str], env: dict[str, str]) -> str | None:
    """sacct's output; None (and sacct not asked again by this process) when accounting is
    off or out of reach, which is said once on standard error."""
    if accounting_problem(env):
        return None
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=30,
                              check=False)
    except subprocess.TimeoutExpired:
        problem = "sacct did not answer within 30 s"
    except OSError as exc:
        problem = f"sacct cannot run ({exc.strerror or exc})"
    else:
        if done.returncode == 0:
            return done.stdout.strip()
        lines = [ln.strip() for ln in done.stderr.splitlines() if ln.strip()]
        problem = lines[-1].removeprefix("sacct: error: ") if lines else f"exit {done.returncode}"
    _ACCOUNTING[_where(env)] = problem
    print(f"hpc_ddp: Slurm accounting cannot be read here ({problem}): a job's end is taken "
          "from squeue while Slurm keeps the job, then from the run's own records "
          "(docs/slurm.md#without-accounting).", file=sys.stderr, flush=True)
    return None


class SlurmJobView:
    """What ``follow`` needs of a Slurm job: id, state, done(), cancel()."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self._last: JobState | None = None

    @property
    def state(self) -> str:
        return self._last.state if self._last else "UNKNOWN"

    @property
    def exit_code(self) -> str:
        return self._last.exit_code if self._last else ""

    def done(self) -> bool:
        self._last = query(self.job_id) or self._last
        return bool(self._last and self._last.finished)

    def cancel(self, check: bool = False) -> None:
        """scancel the job; with ``check``, a refusal is a UserError carrying scancel's reason.
        Without scancel on PATH the job cannot be cancelled from here, which is always said."""
        from hpc_ddp.errors import UserError  # deferred (start-up): errors

        try:
            done = subprocess.run(["scancel", self.job_id], capture_output=True, text=True,
                                  check=False)
        except FileNotFoundError:
            raise UserError("job", self.job_id, "cannot be cancelled here: scancel is not on "
                            "PATH.", f"run `scancel {self.job_id}` on a login node of the "
                            "cluster.") from None
        if check and done.returncode != 0:
            said = next((ln.strip() for ln in done.stderr.splitlines() if ln.strip()), "")
            raise UserError("job", self.job_id, f"scancel refused: {said or done.returncode}",
                            "check the id with `squeue -j` / `sacct -j`, and that a Slurm "
                            "controller answers (`scontrol ping`).")
