"""An override's value as the composed config reads it, on every path that reads one from
the command line before composing (issue 46): a sweep's first point on the laptop, a remote
resume, a remote dry run. One reader (config/given.py), on Hydra's parser."""

from __future__ import annotations

import io
import random
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_ddp.config import given
from hpc_ddp.config.compose import compose
from hpc_ddp.errors import UserError
from hpc_ddp.remote import handle, intent, submit_remote
from tests.conftest import REPO

# Every spelling a bool field may take on the command line, and some it may not.
SPELLINGS = ["true", "True", "TRUE", "tRuE", "false", "FALSE", "yes", "YES", "Yes", "y", "Y",
             "on", "ON", "On", "no", "No", "n", "N", "off", "OFF", "1", "0", "'true'",
             "\"yes\"", "'1'", "'0'", "' yes'", "'on '", "2", "1.0", "maybe", "null", "''",
             "'2'", " true", "${oc.env:HOME}", "[1]"]


def _composed(value: str) -> bool | None:
    """``resume`` as the composed, typed config reads ``resume=value`` (None: refused)."""
    try:
        return compose([f"resume={value}", "run_dir=/tmp/x"]).resume
    except UserError:
        return None


@pytest.mark.parametrize("value", SPELLINGS)
def test_a_boolean_override_reads_as_the_composed_config_reads_it(value: str) -> None:
    expected = _composed(value)
    # Refused by compose: read as not set (compose says why, with its own message).
    assert given.flag([f"resume={value}"], "resume") is bool(expected)


def test_the_last_value_wins_and_a_plus_prefix_is_the_same_key() -> None:
    assert given.flag(["resume=true", "+resume=off"], "resume") is False
    assert given.flag(["dry_run=no", "++dry_run=yes"], "dry_run") is True
    assert given.flag(["nodes=2"], "resume") is False
    assert given.text(["run_dir=a", "run_dir='/b c'"], "run_dir") == "/b c"
    assert given.text(["run_dir=null"], "run_dir") is None
    assert given.text(["cluster.remote="], "cluster.remote") is None
    assert given.text(["run_dir=x", "~run_dir"], "run_dir") is None


def test_a_remote_resume_is_a_resume_however_the_boolean_is_spelled(tmp_path: Path) -> None:
    handle.write(tmp_path, handle.Handle("login", "/r", "abc", ["python3"]))
    for spelling in ("true", "yes", "on", "1", "Y", "'true'", "TRUE"):
        assert intent.wanted([f"run_dir={tmp_path}", f"resume={spelling}"]), spelling
        assert submit_remote._resumed([f"run_dir={tmp_path}", f"resume={spelling}"],
                                      tmp_path) is not None, spelling
    for spelling in ("false", "no", "off", "0", "n"):
        assert not intent.wanted([f"run_dir={tmp_path}", f"resume={spelling}"]), spelling


def test_reading_resume_for_a_local_run_imports_no_hydra(tmp_path: Path) -> None:
    # `python -m hpc_ddp.submit` asks intent.wanted first: a plain word is read without the
    # grammar (Hydra's import is ~0.2 s), a quoted one with it.
    code = ("import sys; from hpc_ddp.remote import intent; "
            f"intent.wanted(['run_dir={tmp_path}', 'resume=yes', 'cluster.remote=null', "
            "'trainer.max_steps=3']); print('hydra' in sys.modules)")
    said = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, check=True)
    assert said.stdout.strip() == "False"


class _Reached(Exception):
    pass


def test_a_remote_sweep_checks_its_first_point_as_hydra_splits_it(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen: list[list[str]] = []

    def composed(overrides: list[str], config_dir: object = None) -> object:
        seen.append(list(overrides))
        raise _Reached

    monkeypatch.setattr("hpc_ddp.config.compose.compose", composed)
    with pytest.raises(_Reached):  # the first point passed the checks and was composed
        submit_remote.submit(["cluster=slurm", "cluster.remote=login",
                              "cluster.setup=[module load a,module load b]",
                              "optim.lr=0.1,0.01", "trainer.seed=range(3,5)"],
                             None, True, io.StringIO(), environ={}, cwd=tmp_path)
    assert seen == [["cluster=slurm", "cluster.remote=login",
                     "cluster.setup=[module load a,module load b]", "optim.lr=0.1",
                     "trainer.seed=3"]]


def test_what_is_read_without_hydra_is_what_hydra_reads() -> None:
    # The fast path (config/given.py) against Hydra's parser, over words, paths, hosts and
    # near-numbers built from the characters where the two could differ.
    from hydra.core.override_parser.overrides_parser import OverridesParser

    rng = random.Random(46)
    samples = ["", "0", "1", "/tmp/a-1.5", "u@h.example.org", "host:22", "1_0", "nan", "-1",
               "True", "NULL", "e5", "1.", ".5", "./x", "inf/x", "x/1e5"]
    samples += ["".join(rng.choice("a1_0./-+@:eEtrunfliNxy9") for _ in range(rng.randint(1, 6)))
                for _ in range(3000)]
    parser = OverridesParser.create()
    for sample in samples:
        quick = given._plain(sample)
        if quick is given._UNPARSED:
            continue
        hydra = parser.parse_overrides([f"k={sample}"])[0].value()
        assert (type(quick), quick) == (type(hydra), hydra), sample
