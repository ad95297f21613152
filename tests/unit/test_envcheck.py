"""The software fingerprint compared at the rendezvous, with real torch stores: O(1) store
calls per rank, the odd nodes and packages named by rank 0, every rank stopped."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from hpc_ddp.rank.join import envcheck
from hpc_ddp.rank.join.envcheck import EnvironmentMismatch, Fingerprint
from tests.unit.test_rendezvous import Recording, env_of

BASE = Fingerprint({"python": "3.11.7", "torch": "2.4.1", "cuda": "12.4", "nccl": "2.21.5",
                    "cudnn": "90100"}, {"numpy": "2.1.0", "torch": "2.4.1"})
ODD = Fingerprint(dict(BASE.versions), {**BASE.packages, "fake-drift": "1.0"})


def placements(prints: list[Fingerprint]) -> list[dict[str, Any]]:
    return [{"rank": r, "host": f"node{r + 1}", envcheck.RECORD_KEY: p.digest}
            for r, p in enumerate(prints)]


def check_all(prints: list[Fingerprint], allow_mixed: bool = False
              ) -> tuple[dict[int, Any], list[Recording]]:
    """Every rank's envcheck.check in its own thread on one real store: what each returned
    or raised, and each rank's store calls."""
    import torch.distributed as dist

    shared = dist.HashStore()
    world = len(prints)
    views = [Recording(shared) for _ in range(world)]
    outcome: dict[int, Any] = {}

    def rank(r: int) -> None:
        try:
            outcome[r] = envcheck.check(views[r], env_of(r, world), prints[r],
                                        placements(prints) if r == 0 else None, allow_mixed, 10)
        except BaseException as exc:  # noqa: BLE001 (the outcome under test)
            outcome[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return outcome, views


@pytest.mark.parametrize("world", [8, 256])
def test_the_same_software_everywhere_costs_each_rank_a_couple_of_store_calls(
        world: int) -> None:
    outcome, views = check_all([BASE] * world)
    assert all(outcome[r] == [] for r in range(world))
    assert views[0].calls == 2  # the verdict and the empty ask list
    assert max(v.calls for v in views[1:]) == 2  # read the ask list, read the verdict


def test_one_odd_node_is_named_with_its_package_and_every_rank_stops() -> None:
    outcome, views = check_all([BASE, BASE, ODD, BASE])
    assert isinstance(outcome[0], EnvironmentMismatch)
    message = str(outcome[0])
    assert "node(s) node3 (1 rank(s), e.g. rank 2): fake-drift 1.0 (others not installed)" in (
        message)
    assert "cluster.exclude=node3" in message and "allow_mixed_env=true" in message
    assert all(isinstance(outcome[r], SystemExit) for r in (1, 2, 3))
    # Only the odd rank sent its details (rank 0 has its own, the majority's); at most five
    # store calls on any rank.
    store = views[0].store
    assert [r for r in range(4) if store.check([f"hpc_ddp/env/detail/{r}"])] == [2]
    assert max(v.calls for v in views) <= 5


def test_a_mixed_run_may_go_on_when_allowed_and_says_what_differs() -> None:
    outcome, _ = check_all([BASE, ODD, ODD, BASE, BASE], allow_mixed=True)
    assert outcome[0] == ["node2: fake-drift 1.0 (others not installed)",
                          "node3: fake-drift 1.0 (others not installed)"]
    assert outcome[1] == outcome[0] and outcome[4] == outcome[0]


def test_the_majority_is_the_reference_even_when_rank_0_is_odd() -> None:
    outcome, _ = check_all([ODD, BASE, BASE], allow_mixed=True)
    assert outcome[0] == ["node1: fake-drift 1.0 (others not installed)"]


def test_differences_name_versions_and_packages() -> None:
    other = Fingerprint({**BASE.versions, "torch": "2.3.0"}, {"torch": "2.3.0"})
    assert envcheck.differences(other, BASE) == [
        "torch 2.3.0 (others 2.4.1)", "numpy not installed (others 2.1.0)",
        "torch 2.3.0 (others 2.4.1)"]
    assert BASE.digest != other.digest and BASE.digest == Fingerprint(
        dict(BASE.versions), dict(BASE.packages)).digest


def test_this_interpreters_fingerprint_and_its_drift_from_environment_yml(
        tmp_path: Path) -> None:
    mine = envcheck.fingerprint()
    assert mine.versions["torch"] and "torch" in mine.packages and "hpc-ddp" in mine.packages
    assert set(mine.summary()) == {*envcheck.VERSION_KEYS, "packages", "hash"}
    env_file = tmp_path / "environment.yml"
    env_file.write_text("dependencies:\n  - python=3.11\n  - pip\n  - pip:\n"
                        "      - torch==2.4.1\n      - Py_Yaml==6.0\n")
    pins = envcheck.read_pins(env_file)
    assert pins == {"python": "3.11", "torch": "2.4.1", "py-yaml": "6.0"}
    assert envcheck.drift(pins, BASE) == ["py-yaml not installed (environment.yml: 6.0)"]
    local = Fingerprint({**BASE.versions, "python": "3.11.7"},
                        {"torch": "2.4.1+cu124", "py-yaml": "6.0"})
    assert envcheck.drift(pins, local) == []  # a local version suffix is the same release


def test_distributions_come_from_folder_names_first_on_the_path_winning(
        tmp_path: Path) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    (first / "Fake_Drift-1.0.dist-info").mkdir(parents=True)
    (first / "old_style-2.1-py3.11.egg-info").mkdir()
    (first / "Checkout.egg-info").mkdir()  # a source checkout's: no version in the name
    (first / "Checkout.egg-info" / "PKG-INFO").write_text(
        "Metadata-Version: 2.1\nName: Checkout\nVersion: 0.4.dev0\n")
    (second / "fake.drift-0.9.dist-info").mkdir(parents=True)
    found = envcheck.installed([str(first), str(second), str(tmp_path / "missing")])
    assert found == {"fake-drift": "1.0", "old-style": "2.1", "checkout": "0.4.dev0"}
