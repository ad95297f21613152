"""python -m hpc_ddp.logs: ranks merged in time order with attempt markers, one rank read
alone, --grep, --since, --tail, --point, bad options refused in one line."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from hpc_ddp import ranklines
from hpc_ddp.errors import USAGE_EXIT_CODE
from hpc_ddp.watch import logs

T0 = 1_800_000_000.0


def _run(root: Path) -> Path:
    (root / "logs").mkdir(parents=True)
    for rank, host in ((0, "n1"), (1, "n2")):
        text = [ranklines.line(rank, host, ranklines.ATTEMPT,
                               ranklines.attempt_text("7", 0, 0), T0 + rank * 0.001)]
        text += [ranklines.line(rank, host, ranklines.OUT, f"epoch {e} from {rank}",
                                T0 + 10 * e + rank) for e in range(2)]
        text.append(ranklines.line(rank, host, ranklines.ATTEMPT,
                                   ranklines.attempt_text("7", 1, 0), T0 + 100 + rank * 0.001))
        text.append(ranklines.line(rank, host, ranklines.ERR,
                                   f"Traceback on {rank}\n  File x, line 1", T0 + 110 + rank))
        (root / "logs" / f"rank{rank}.log").write_text("".join(text))
    return root


def _show(*argv: str) -> tuple[int, list[str]]:
    out = io.StringIO()
    code = logs.main(list(argv), out=out)
    return code, out.getvalue().splitlines()


def test_merged_in_time_order_with_attempt_markers(tmp_path: Path) -> None:
    run = _run(tmp_path / "run")
    code, lines = _show(str(run))
    assert code == 0
    assert [ln.split(" ", 1)[1] if not ln.startswith("---") else ln.split(" (")[0]
            for ln in lines] == [
        "--- attempt: job 7, restart 0, generation 0",
        "[rank 0 n1] OUT epoch 0 from 0", "[rank 1 n2] OUT epoch 0 from 1",
        "[rank 0 n1] OUT epoch 1 from 0", "[rank 1 n2] OUT epoch 1 from 1",
        "--- attempt: job 7, restart 1, generation 0",
        "[rank 0 n1] ERR Traceback on 0", "[rank 0 n1] ERR   File x, line 1",
        "[rank 1 n2] ERR Traceback on 1", "[rank 1 n2] ERR   File x, line 1"]


def test_the_attempt_marker_says_when_the_attempt_began(tmp_path: Path) -> None:
    """Not when its first shown line was printed: the second attempt began at T0 + 100, its
    first line came 10 s later."""
    run = _run(tmp_path / "run")
    _, lines = _show(str(run))
    markers = [ln for ln in lines if ln.startswith("--- attempt")]
    assert markers[1].endswith(f"({ranklines.stamp(T0 + 100)[:19]}) ---"), markers


def test_a_rank_the_run_does_not_have_is_refused(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    run = _run(tmp_path / "run")
    (run / "ranks").mkdir()
    (run / "ranks" / "rank0.json").write_text(json.dumps({"world_size": 2}))
    code, _ = _show(str(run), "--rank", "3")
    assert code == USAGE_EXIT_CODE
    assert capsys.readouterr().err.strip() == (
        "error: --rank=3: the run has 2 ranks (0-1). Fix: give ranks below 2.")


def test_one_rank_grep_since_tail(tmp_path: Path) -> None:
    run = _run(tmp_path / "run")
    (run / "logs" / "rank0.log").chmod(0)  # --rank 1 never opens rank 0's file
    _, lines = _show(str(run), "--rank", "1")
    assert all("[rank 1 n2]" in ln for ln in lines if not ln.startswith("---"))
    (run / "logs" / "rank0.log").chmod(0o644)
    _, lines = _show(str(run), "--grep", "epoch 1")
    assert [ln.split("] ", 1)[1] for ln in lines if not ln.startswith("---")] == [
        "OUT epoch 1 from 0", "OUT epoch 1 from 1"]
    when = ranklines.stamp(T0 + 105)
    _, lines = _show(str(run), "--since", when[:19])
    assert len([ln for ln in lines if "Traceback" in ln]) == 2 and "epoch" not in str(lines)
    _, lines = _show(str(run), "--tail", "1")
    assert lines[-1].endswith("[rank 1 n2] ERR   File x, line 1")


def test_a_sweep_point(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    point = _run(sweep / "001")
    (sweep / "000").mkdir()
    (sweep / "sweep.json").write_text(json.dumps({"points": [
        {"run_dir": str(sweep / "000"), "overrides": []},
        {"run_dir": str(point), "overrides": []}]}))
    code, lines = _show(str(sweep), "--point", "1")
    assert code == 0 and "epoch 0 from 1" in "\n".join(lines)
    code, _ = _show(str(sweep))
    assert code == USAGE_EXIT_CODE


@pytest.mark.parametrize("argv, key", [
    (["--rank", "-1"], "--rank"), (["--ranks", "3-1"], "--ranks"),
    (["--grep", "("], "--grep"), (["--since", "yesterday-ish"], "--since"),
    (["--point", "0"], "--point"), (["--tail", "-2"], "--tail")])
def test_bad_options_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                              argv: list[str], key: str) -> None:
    run = _run(tmp_path / "run")
    code, lines = _show(str(run), *argv)
    err = capsys.readouterr().err
    assert code == USAGE_EXIT_CODE and not lines
    assert len(err.strip().splitlines()) == 1 and key in err


def test_parse_ranks_and_since() -> None:
    assert logs.parse_ranks("0-3,7") == [0, 1, 2, 3, 7]
    import datetime as dt
    now = dt.datetime(2026, 11, 30, 14, 0, 0)
    assert logs.parse_since("10m", now) == "2026-11-30 13:50:00.000"
    assert logs.parse_since("09:30", now) == "2026-11-30 09:30:00.000"


def test_follow_reads_a_large_run_in_turn_and_misses_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Following 600 ranks reads FOLLOW_BATCH files a look (not all 600 twice a second); a
    line any rank writes meanwhile is printed, and the follow ends with the run."""
    import threading
    import time

    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    for rank in range(600):
        (run / "logs" / f"rank{rank}.log").write_text(
            ranklines.line(rank, "n", ranklines.ATTEMPT, ranklines.attempt_text("7", 0, 0)))
    looks = {"n": 0}
    opened: list[int] = []
    real_read = logs.RankFile.read_new

    def counted(self: logs.RankFile) -> list[logs.Shown]:
        opened.append(looks["n"])
        return real_read(self)

    def ended(root: Path) -> bool:
        looks["n"] += 1
        return looks["n"] > 8

    monkeypatch.setattr(logs, "POLL_S", 0.01)
    monkeypatch.setattr(logs, "STATE_EVERY_S", 0.0)
    monkeypatch.setattr(logs, "ended", ended)
    monkeypatch.setattr(logs.RankFile, "read_new", counted)

    def write() -> None:
        time.sleep(0.03)
        with open(run / "logs" / "rank599.log", "a") as handle:
            handle.write(ranklines.line(599, "n", ranklines.OUT, "late news"))

    writer = threading.Thread(target=write)
    writer.start()
    out = io.StringIO()
    assert logs.show(logs.RunDir(run), None, None, None, follow=True, out=out) == 0
    writer.join()
    assert "[rank 599 n] OUT late news" in out.getvalue()
    per_look = [opened.count(n) for n in range(1, 8)]
    assert max(per_look) <= logs.FOLLOW_BATCH


def test_the_last_lines_of_a_long_log_read_from_its_end(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    text = [ranklines.line(0, "n1", ranklines.ATTEMPT, ranklines.attempt_text("7", 0, 0), T0)]
    text += [ranklines.line(0, "n1", ranklines.OUT, f"line {i} " + "x" * 200, T0 + i)
             for i in range(2000)]
    (run / "logs" / "rank0.log").write_text("".join(text))
    code, lines = _show(str(run), "--tail", "3")
    assert code == 0
    assert lines[0].startswith("--- the attempt that began before these lines")
    assert [ln.split(" OUT ")[1].split(" ")[0:2] for ln in lines[1:]] == [
        ["line", "1997"], ["line", "1998"], ["line", "1999"]]


OSC52 = "\x1b]52;c;cm0gLXJmIH4=\x07"  # writes "rm -rf ~" to the clipboard in many terminals
C1_CSI = "\u009b2J"  # clears the screen where C1 controls are honoured


def test_control_sequences_are_shown_not_obeyed(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "rank0.log").write_text(ranklines.line(
        0, "n1", ranklines.OUT, f"hello {OSC52} and {C1_CSI}\u202eevil", T0))
    _, lines = _show(str(run))
    shown = "\n".join(lines)
    assert "\x1b" not in shown and "\u009b" not in shown and "\u202e" not in shown
    assert "hello \\x1b]52;c;cm0gLXJmIH4=\\x07 and \\x9b2J\\u202eevil" in shown
    _, raw = _show(str(run), "--raw")
    assert OSC52 in "\n".join(raw) and C1_CSI in "\n".join(raw)
    assert OSC52 in (run / "logs" / "rank0.log").read_text()  # the file keeps what was written
