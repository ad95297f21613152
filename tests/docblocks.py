"""The docs' code blocks as tests: every fenced block of README.md and docs/*.md carries a
marker that says what it is, and the blocks a user can run are run (docs/testcluster.md,
"Docs that run as tests").

The marker is an HTML comment on the line right above the opening fence (GitHub shows none
of it)::

    <!-- doc: local -->                  run on this machine (tests/integration/test_docs.py)
    <!-- doc: cluster -->                run on the test cluster (tests/cluster/test_docs.py)
    <!-- doc: local output: COMMAND -->  the block is COMMAND's output (cluster output: too)
    <!-- doc: gpu: WHY -->               needs a GPU: not run
    <!-- doc: site: WHY -->              needs a real site (partitions, data, network): not run
    <!-- doc: skip: WHY -->              runnable, not by the suite (the suite itself, a server)
    <!-- doc: bench local: WHY -->       a benchmark (minutes): run as documented by the
    <!-- doc: bench cluster: WHY -->     benchmark tier, ``make bench-docs`` (tests/cluster/
                                         test_doc_benchmarks.py), not by every suite run
    <!-- doc: file: PATH -->             the block is a part of PATH in this repository
    <!-- doc: text -->                   not a command: a layout, a formula, a format

``bf16`` after ``local`` or ``cluster`` (``<!-- doc: cluster bf16 -->``, ``<!-- doc: local
output bf16: COMMAND -->``): the block's figures are a run's in bf16 on a CPU, which
``trainer.precision=auto`` picks only on a CPU with native bf16 (AVX512-BF16 or AMX); on a CPU
without it the same run trains in fp32 with other losses, so there its figures are compared
as if each had a ``~`` and the word ``bf16`` matches ``fp32`` too (the rest of every line
still as written). On a CPU with native bf16 each figure with a decimal point matches one
within 1 % of it (``NEAR``): another CPU model's bf16 kernels round differently, and the last
digits differ (1.0336 for the page's 1.0344); whole numbers, times and steps still exactly.

In a run block, lines that start with ``$ `` are commands typed into one shell and the lines
under each one its output, compared by ``mismatch``; a block without ``$ `` lines is one bash
script, a ``python`` block one Python script.

In shown output a number is compared as written (a seeded run's losses and accuracies are the
same every time); a figure that differs from run to run (a speed, a time of day, a job id, a
port) is marked with ``~`` before it (``~16564.3 samples/s``, ``slurm job ~42``) and matches
any figure; ``...`` and ``<placeholder>`` match any text.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUN_KINDS = ("local", "cluster")
QUIET_KINDS = ("gpu", "site", "skip", "bench")  # not run by the suite; the reason is required
KINDS = (*RUN_KINDS, *QUIET_KINDS, "file", "text")
# A benchmark block runs where it says: on this machine or against the test cluster.
BENCH_PLACES = RUN_KINDS
# Pages whose blocks are not marked yet, with why; a page on this list fails once it is
# fully marked (then take it off).
NOT_MARKED_YET: dict[str, str] = {}
HELP = ("Put a marker on the line above the block, e.g. <!-- doc: local --> (run here), "
        "<!-- doc: cluster --> (run on the test cluster), <!-- doc: local output: COMMAND --> "
        "(COMMAND's output), <!-- doc: gpu: WHY -->, <!-- doc: site: WHY -->, "
        "<!-- doc: skip: WHY --> (not run), <!-- doc: file: PATH -->, <!-- doc: text -->; "
        "see docs/testcluster.md#docs-that-run-as-tests.")
MARKER = re.compile(r"^\s*<!--\s*doc:\s*(?P<body>.*?)\s*-->\s*$")
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w+-]*)\s*$")
BLOCK_TIMEOUT_S = 240
BENCH_TIMEOUT_S = 1800  # a benchmark block: the longest (bench checkpoint) runs ~10 minutes


@dataclass(frozen=True)
class Marker:
    kind: str  # one of KINDS
    arg: str = ""  # the reason, the path, or the command whose output the block is
    output: bool = False  # "local output: COMMAND"
    place: str = ""  # a bench block's: "local" or "cluster"
    bf16: bool = False  # its figures are a CPU's with native bf16 (module doc)


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository, e.g. docs/quickstart.md
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    marker: Marker | None
    problem: str | None = None  # a marker that cannot be read

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[str]:
    return ["README.md", *sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md"))]


def parse_marker(body: str) -> Marker:
    """``local``, ``local output: CMD``, ``site: why``, ``file: PATH``, ``text``; ValueError
    naming what is wrong."""
    head, colon, arg = body.partition(":")
    words = head.split()
    arg = arg.strip()
    if not words or words[0] not in KINDS:
        raise ValueError(f"unknown kind {head.strip()!r}; use one of {', '.join(KINDS)}")
    bf16 = words[-1:] == ["bf16"] and words[0] in RUN_KINDS
    if bf16:
        words = words[:-1]
    kind, output = words[0], words[1:] == ["output"]
    if kind == "bench":
        if words[1:] not in ([place] for place in BENCH_PLACES):
            raise ValueError("a benchmark says where it runs: <!-- doc: bench local: why --> "
                             "or <!-- doc: bench cluster: why -->")
        if not arg:
            raise ValueError("bench needs a reason after a colon, e.g. "
                             "<!-- doc: bench local: about 2 min here -->")
        return Marker(kind, arg, place=words[1])
    if words[1:] and not (output and kind in RUN_KINDS):
        raise ValueError(f"{head.strip()!r}: only local and cluster take 'output' and 'bf16'")
    if output and not arg:
        raise ValueError("an output marker names its command: <!-- doc: local output: CMD -->")
    if kind in (*QUIET_KINDS, "file") and not arg:
        what, example = ("a path", "conf/config.yaml") if kind == "file" else ("a reason", "why")
        raise ValueError(f"{kind} needs {what} after a colon, e.g. <!-- doc: {kind}: {example} -->")
    if kind in ("local", "cluster", "text") and arg and not output:
        raise ValueError(f"{kind} takes no argument (did you mean '{kind} output: ...'?)")
    return Marker(kind, arg, output, bf16=bf16)


def blocks(page: str) -> list[Block]:
    """Every fenced block of ``page``, with its marker (None when it has none)."""
    lines = (REPO / page).read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        indent = len(fence["indent"])
        text = "\n".join(line[indent:] for line in lines[i + 1:end])
        above = MARKER.match(lines[i - 1]) if i > 0 else None
        marker, problem = None, None
        if above:
            try:
                marker = parse_marker(above["body"])
            except ValueError as exc:
                problem = str(exc)
        found.append(Block(page, i + 1, fence["lang"], text, marker, problem))
        i = end + 1
    return found


def marker_problems(page: str) -> list[str]:
    """What is wrong with the markers of ``page`` (empty when every block is marked well)."""
    problems = []
    lines = (REPO / page).read_text().splitlines()
    fenced = {b.line - 1 for b in blocks(page)}
    for n, line in enumerate(lines):
        if MARKER.match(line) and n + 1 not in fenced:
            problems.append(f"{page}:{n + 1}: a doc marker with no block right under it.")
    for b in blocks(page):
        if b.problem:
            problems.append(f"{b.where}: the marker above this block: {b.problem}.")
        elif b.marker is None:
            problems.append(f"{b.where}: this ```{b.lang} block has no marker. {HELP}")
        elif b.marker.kind == "text" and b.lang in ("bash", "sh", "python", "console"):
            problems.append(f"{b.where}: a ```{b.lang} block is a command, not text: mark it "
                            "local, cluster, or gpu/site/skip with the reason.")
        elif b.marker.kind == "file":
            problems += _file_problem(b)
    return problems


def _file_problem(block: Block) -> list[str]:
    path = REPO / block.marker.arg  # type: ignore[union-attr]
    if not path.is_file():
        return [f"{block.where}: file: {block.marker.arg} does not exist."]  # type: ignore[union-attr]
    shown = [line.rstrip() for line in block.text.splitlines()]
    if shown and shown[0].startswith("#") and block.marker.arg in shown[0]:  # type: ignore[union-attr]
        shown = shown[1:]  # "# examples/x.yaml": the file's name, for the reader
    real = [line.rstrip() for line in path.read_text().splitlines()]
    if any(real[i:i + len(shown)] == shown for i in range(len(real) - len(shown) + 1)):
        return []
    return [f"{block.where}: the block is no longer a part of {block.marker.arg}; copy the "  # type: ignore[union-attr]
            "file's lines into the doc again."]


def runnable(kind: str, place: str = "") -> list[tuple[str, list[Block]]]:
    """(page, its blocks of this kind, in page order) for every page that has some; for
    ``bench``, those that run at ``place``."""
    found = []
    for page in pages():
        mine = [b for b in blocks(page) if b.marker and b.marker.kind == kind
                and b.marker.place == place]
        if mine:
            found.append((page, mine))
    return found


# -- comparing output ----------------------------------------------------------------------
# A figure: digits, with dots or colons between them (0.4141, 16564.3, 08:12:43,
# 127.0.0.1:41741), an exponent; "~" before one in shown output: it varies (module doc).
FIGURE = r"[-+]?\d+(?:[.:]\d+)*(?:e[-+]?\d+)?"
VARIES = "~"
_PLACEHOLDERS = r"\.\.\.|…|<[^<>\s][^<>]*>|\s+"
_TOKEN = re.compile(rf"{_PLACEHOLDERS}|{VARIES}{FIGURE}")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


# A bf16 block on a CPU without native bf16: its figures and the precision it names vary.
_TOKEN_ANY_FIGURE = re.compile(rf"{_PLACEHOLDERS}|\bbf16\b|{VARIES}?{FIGURE}")


# A bf16 block on another CPU with native bf16: its figures may differ in the last digits
# (the docs say so: another CPU model's bf16 kernels round differently), within this share.
NEAR = 0.01
_TOKEN_NEAR = re.compile(rf"{_PLACEHOLDERS}|{VARIES}?{FIGURE}")


class NearLine:
    """A shown line whose figures match a figure within NEAR of theirs (a whole number, and a
    time or an address, exactly); the rest as :func:`line_pattern` makes it."""

    def __init__(self, pattern: re.Pattern[str], figures: list[str]) -> None:
        self.pattern, self.figures = pattern, figures

    def fullmatch(self, text: str) -> bool:
        found = self.pattern.fullmatch(text)
        return found is not None and all(
            _near(want, got) for want, got in zip(self.figures, found.groups(), strict=True))


def _near(want: str, got: str) -> bool:
    if not re.fullmatch(r"[-+]?\d+\.\d+(?:e[-+]?\d+)?", want):
        return want == got  # 20/20's parts, 08:12:43, 127.0.0.1:41741, a count
    try:
        return abs(float(got) - float(want)) <= max(NEAR * abs(float(want)), 1e-4)
    except ValueError:
        return False


def line_pattern(shown: str, figures_vary: bool = False,
                 near: bool = False) -> re.Pattern[str] | NearLine:
    """A shown line as a pattern: ``~`` and a figure match any figure, ``...`` (or ``…``)
    any text, ``<placeholder>`` any text, a run of spaces any run of spaces; the rest, other
    numbers included, is literal (``figures_vary``: every figure matches any figure;
    ``near``: a figure without ``~`` matches one within NEAR of it, NearLine)."""
    out, pos, figures = [], 0, []
    tokens = _TOKEN_ANY_FIGURE if figures_vary else _TOKEN_NEAR if near else _TOKEN
    for m in tokens.finditer(shown):
        out.append(re.escape(shown[pos:m.start()]))
        token = m.group()
        if token in ("...", "…") or token.startswith("<"):
            out.append(".*?")
        elif token.isspace():
            out.append(r"\s+")
        elif token == "bf16":
            out.append("(?:bf16|fp32)")
        elif near and not token.startswith(VARIES):
            out.append(f"({FIGURE})")
            figures.append(token)
        else:
            out.append(f"(?:{FIGURE})" if near else FIGURE)
        pos = m.end()
    out.append(re.escape(shown[pos:]))
    pattern = re.compile("".join(out))
    return NearLine(pattern, figures) if near else pattern


def _lines(text: str) -> list[str]:
    return [ANSI.sub("", line).rstrip() for line in text.splitlines() if line.strip()]


def mismatch(shown: str, actual: str, figures_vary: bool = False,
             near: bool = False) -> str | None:
    """None when ``actual`` is what ``shown`` describes: every shown line matches one line, in
    order, and a line ``...`` stands for any number of lines (blank lines are left out on
    both sides). Otherwise the first shown line that does not fit."""
    want, got = _lines(shown), _lines(actual)
    patterns = [None if w.strip() in ("...", "…") else line_pattern(w.strip(), figures_vary,
                                                                  near) for w in want]
    best = [0]  # the furthest shown line reached, for the message

    def fits(i: int, j: int, memo: dict[tuple[int, int], bool]) -> bool:
        if (i, j) in memo:
            return memo[(i, j)]
        best[0] = max(best[0], i)
        if i == len(patterns):
            ok = j == len(got)
        elif patterns[i] is None:
            ok = any(fits(i + 1, k, memo) for k in range(j, len(got) + 1))
        else:
            ok = j < len(got) and bool(patterns[i].fullmatch(got[j].strip())) and fits(
                i + 1, j + 1, memo)
        memo[(i, j)] = ok
        return ok

    if fits(0, 0, {}):
        return None
    if best[0] >= len(want):
        return "the output has more lines than the doc shows (end the block with ... if so)"
    return f"no output line fits the doc's line {best[0] + 1}: {want[best[0]]!r}"


# -- running -------------------------------------------------------------------------------
# Commands a shown block may use that would not end, or that need what a test has not:
# `tensorboard --logdir DIR` checks DIR holds event files instead of serving them; `tail -f`
# prints the file's end; `sudo` runs the command as it is when the tests already run as root.
PRELUDE = r"""
tensorboard() {
  [ "$1" = --logdir ] && [ -n "$2" ] \
    || { echo "tensorboard: the docs test knows --logdir DIR only" >&2; return 2; }
  find "$2" -name 'events.out.tfevents.*' | grep -q . \
    || { echo "tensorboard: no event files under $2" >&2; return 1; }
}
tail() { if [ "$1" = -f ]; then shift; fi; command tail "$@"; }
if ! command -v sudo >/dev/null && [ "$(id -u)" = 0 ]; then sudo() { "$@"; }; fi
"""


def checkout(folder: Path) -> Path:
    """A folder that looks like a clone of this repository to a reader's commands (`source
    .venv/bin/activate`, `sbatch jobs/train.sbatch`, `cd examples/seqproject`): links to the
    repository's top-level entries, examples/ copied (commands write into it), and no
    outputs/ or multirun/ of the repository's own."""
    folder.mkdir(parents=True, exist_ok=True)
    skip = {".git", "outputs", "multirun", "examples", ".pytest_cache"}
    for entry in REPO.iterdir():
        if entry.name not in skip and not (folder / entry.name).exists():
            (folder / entry.name).symlink_to(entry)
    shutil.copytree(REPO / "examples", folder / "examples", dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("outputs", "multirun", "__pycache__"))
    (folder / "home").mkdir(exist_ok=True)
    return folder


def environment(folder: Path, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """A reader's shell after `source .venv/bin/activate`, with a HOME of its own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PYTEST_"))}
    env.update(HOME=str(folder / "home"), VIRTUAL_ENV=str(REPO / ".venv"),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")
    env.update(extra or {})
    return env


@dataclass(frozen=True)
class Step:
    """One thing to run for a block: a command (or a script) and the output it should show."""
    command: str
    shown: str | None  # None: not compared
    python: bool = False


def steps(block: Block) -> Iterator[Step]:
    marker = block.marker
    assert marker is not None and (marker.kind in RUN_KINDS or marker.kind == "bench")
    if marker.output:
        yield Step(marker.arg, block.text)
        return
    if block.lang == "python":
        yield Step(block.text, None, python=True)
        return
    lines = block.text.splitlines()
    if not any(line.startswith("$ ") for line in lines):
        yield Step(block.text, None)
        return
    command: str | None = None
    shown: list[str] = []
    for line in lines:
        if line.startswith("$ "):
            if command is not None:
                yield Step(command, "\n".join(shown))
            command, shown = line[2:], []
        elif command is not None and command.endswith("\\") and not shown:
            command += "\n" + line
        else:
            shown.append(line)
    if command is not None:
        yield Step(command, "\n".join(shown))


def run_step(step: Step, folder: Path, env: Mapping[str, str],
             timeout_s: float = BLOCK_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """A script (stops at its first failing command and names it) or a Python block, in
    ``folder``; both output streams in one, in the order a terminal shows them."""
    if step.python:
        script = folder / ".doc_block.py"
        script.write_text(step.command)
        argv = [sys.executable, str(script)]
    else:
        script = folder / ".doc_block.sh"
        script.write_text("set -eo pipefail\n"
                          "trap 'echo \"docs test: this command failed: $BASH_COMMAND\" >&2' ERR\n"
                          f"{PRELUDE}\n{step.command}\n")
        argv = ["bash", str(script)]
    return subprocess.run(argv, cwd=folder, env=dict(env), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout_s,
                          check=False, stdin=subprocess.DEVNULL)


_MARK = "@@docs-test@@"


def run_session(commands: Sequence[str], folder: Path, env: Mapping[str, str],
                timeout_s: float = BLOCK_TIMEOUT_S) -> list[tuple[int, str, float]]:
    """The ``$`` commands of a block in one shell, as typed one after the other in a terminal
    (a ``cd`` or an ``export`` holds for the next): (exit code, output, seconds) of each."""
    lines = ["exec 2>&1", PRELUDE]
    for i, command in enumerate(commands):
        lines += [f"printf '\\n{_MARK} begin %d %s\\n' {i} \"$(date +%s.%N)\"", command,
                  f"printf '\\n{_MARK} end %d %d %s\\n' {i} $? \"$(date +%s.%N)\""]
    script = folder / ".doc_session.sh"
    script.write_text("\n".join(lines) + "\n")
    done = subprocess.run(["bash", str(script)], cwd=folder, env=dict(env),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout_s * max(1, len(commands)), check=False,
                          stdin=subprocess.DEVNULL)
    found: list[tuple[int, str, float]] = []
    for i in range(len(commands)):
        begin = re.search(rf"\n?{_MARK} begin {i} (\S+)\n", done.stdout)
        end = re.search(rf"\n?{_MARK} end {i} (\d+) (\S+)\n", done.stdout)
        if not (begin and end):
            found.append((-1, done.stdout[begin.end() if begin else 0:], 0.0))
            break
        found.append((int(end[1]), done.stdout[begin.end():end.start()],
                      float(end[2]) - float(begin[1])))
    return found


def same_precision(block: Block) -> bool:
    """Whether this machine trains in the precision the block's figures come from: a ``bf16``
    block's are a CPU's with native bf16 (module doc); any other block's hold everywhere."""
    if block.marker is None or not block.marker.bf16:
        return True
    from hpc_ddp.rank.services.precision import cpu_has_native_bf16

    return cpu_has_native_bf16()


def check_block(block: Block, folder: Path, env: Mapping[str, str],
                keep: Path | None = None) -> list[str]:
    """Run ``block`` in ``folder``; what went wrong (empty when the block did what it shows).
    ``keep``: a folder that gets each command's whole output, ``PAGE-LINE.log`` (the
    benchmark tier keeps the figures a page's tables are copied from)."""
    todo = list(steps(block))
    bench = block.marker is not None and block.marker.kind == "bench"
    timeout_s = BENCH_TIMEOUT_S if bench else BLOCK_TIMEOUT_S
    if all(s.shown is not None for s in todo):  # commands with their output, typed in a shell
        results = run_session([s.command for s in todo], folder, env, timeout_s)
    else:
        results = []
        for step in todo:
            began = time.monotonic()
            done = run_step(step, folder, env, timeout_s)
            results.append((done.returncode, done.stdout, time.monotonic() - began))
    problems = []
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        name = block.where.replace("/", "_").replace(":", "-")
        (keep / f"{name}.log").write_text("".join(
            f"$ {step.command}\n{output}\n# exit {code}, {took:.1f} s\n\n"
            for step, (code, output, took) in zip(todo, results, strict=False)))
    for step, (code, output, took) in zip(todo, results, strict=False):
        first = step.command.splitlines()[0] if step.command.strip() else "(empty)"
        print(f"{block.where}: {took:5.1f} s  {first[:90]}")
        said = f"\n--- output ---\n{output[-3000:]}"
        expect_error = step.shown is not None and any(
            line.startswith("error:") for line in step.shown.splitlines())
        if code < 0:
            problems.append(f"{block.where}: `{first}` did not end (the shell left).{said}")
        elif expect_error and code == 0:
            problems.append(f"{block.where}: `{first}` exited 0, but the doc shows an error.{said}")
        elif not expect_error and code != 0:
            problems.append(f"{block.where}: `{first}` exited {code}.{said}")
        elif step.shown is not None and step.shown.strip():
            same = same_precision(block)
            wrong = mismatch(step.shown, output, figures_vary=not same,
                             near=same and block.marker is not None and block.marker.bf16)
            if wrong:
                problems.append(f"{block.where}: `{first}`: {wrong}.{said}")
        if problems:
            break
    return problems
