"""Slurm jobs' states: squeue for what the controller holds, sacct for what has ended.

One ``squeue`` and at most one ``sacct`` per look, for one job or a whole sweep: array
tasks are asked for by their array's id, so a 1,000-point sweep in 100 arrays is still two
calls (a status refresh every 5 s must not become ~100 calls a second against slurmctld
and slurmdbd). squeue comes first because its state and pending reason are live (accounting
keeps the reason a job had when it was submitted); sacct answers for jobs squeue no longer
lists, with Slurm's raw text ("CANCELLED by 1000") and the exit code.

submitit's own ``done()`` trusts its result files, which an earlier attempt of a requeued
job leaves behind; following a job that requeues itself needs Slurm's word.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from hpc_ddp.slurm.cost import FIELDS, Cost, Record, cost_of

# States after which the job will not run again (REQUEUED, PENDING, RUNNING, PREEMPTED and
# SUSPENDED are not: a requeued or preempted job comes back). https://slurm.schedmd.com/sacct.html#SECTION_JOB-STATE-CODES
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "BOOT_FAIL", "DEADLINE")
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
    most one sacct call, whatever their number; a job neither knows is left out."""
    env = dict(os.environ if environ is None else environ)
    ids = list(dict.fromkeys(str(i) for i in job_ids))
    if not ids:
        return {}
    live = parse_squeue(_run(squeue_command(_asked(ids)), env))
    found = {i: live[i] for i in ids if i in live}
    ended = [i for i in ids if i not in found or found[i].finished]
    if ended:
        accounted = parse_sacct(_run(sacct_command(_asked(ended)), env))
        for i in ended:
            state = accounted.get(i)
            if state is not None:
                found[i] = state
    return found


def _asked(ids: Sequence[str]) -> list[str]:
    """The ids to name on the command line: an array task's array (123_4 -> 123; squeue -r
    and sacct then list every task of it, including the ones that never started)."""
    return list(dict.fromkeys(i.split("_")[0] for i in ids))


def squeue_command(asked: Sequence[str]) -> list[str]:
    command = ["squeue", "-h", "-r", "-j", ",".join(asked), "-o", SQUEUE_FORMAT]
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
    found = parse_costs(_run(accounted_command(_asked(ids)), env)) if ids else {}
    return {i: found[i] for i in ids if i in found}


def query_with_cost(job_ids: Iterable[str], environ: Mapping[str, str] | None = None
                    ) -> tuple[dict[str, JobState], dict[str, Cost]]:
    """:func:`query_many`, and what each job cost so far: one squeue call and one sacct
    call, whatever the number of jobs (a status refresh)."""
    env = dict(os.environ if environ is None else environ)
    ids = list(dict.fromkeys(str(i) for i in job_ids))
    if not ids:
        return {}, {}
    live = parse_squeue(_run(squeue_command(_asked(ids)), env))
    text = _run(accounted_command(_asked(ids)), env)
    accounted = parse_sacct(text)
    found = {i: live[i] for i in ids if i in live}
    for i in ids:
        if (i not in found or found[i].finished) and i in accounted:
            found[i] = accounted[i]
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
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=30,
                              check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


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
