"""How the suite spreads over pytest-xdist's workers (tests/conftest.py): two chains of
cluster modules, one per test cluster, and the other tests on every worker."""

from __future__ import annotations

from tests.conftest import (
    CLUSTER_MODULE_SECONDS,
    LOCAL_UNIT_SECONDS,
    cluster_chains,
    cluster_instance,
    next_unit,
    work_unit,
)

UNITS = ["tests/cluster/test_docs.py", "tests/cluster/test_layouts.py",
         "tests/unit/test_a.py::test_x", "tests/cluster/test_fault_tolerance.py",
         "tests/integration/test_matrix.py", "tests/cluster/test_new_module.py"]


def test_units_are_cluster_modules_and_single_tests() -> None:
    assert work_unit("tests/cluster/test_layouts.py::test_one[a]") == \
        "tests/cluster/test_layouts.py"
    assert work_unit("tests/integration/test_matrix.py::test_row[3]") == \
        "tests/integration/test_matrix.py"
    assert work_unit("tests/unit/test_a.py::test_x") == "tests/unit/test_a.py::test_x"


def test_chains_leave_a_worker_for_the_other_tests() -> None:
    assert cluster_chains(3, {}) == 2
    assert cluster_chains(2, {}) == 1  # as before: one chain, one worker for the rest
    assert cluster_chains(1, {}) == 1
    assert cluster_chains(4, {"HPC_DDP_TEST_CLUSTERS": "1"}) == 1
    assert [cluster_instance(w) for w in ("gw0", "gw1", "gw2", None)] == [0, 1, 2, 0]


def test_chain_workers_take_the_costliest_cluster_module_they_may_run() -> None:
    assert CLUSTER_MODULE_SECONDS["test_fault_tolerance.py"] > \
        CLUSTER_MODULE_SECONDS["test_docs.py"] > CLUSTER_MODULE_SECONDS["test_layouts.py"] > 60
    assert next_unit(UNITS, 0, 2) == "tests/cluster/test_fault_tolerance.py"
    rest = [u for u in UNITS if u != "tests/cluster/test_fault_tolerance.py"]
    # test_docs.py runs the testcluster page's commands on the default cluster only.
    assert next_unit(rest, 1, 2) == "tests/cluster/test_layouts.py"
    assert next_unit(rest, 0, 2) == "tests/cluster/test_docs.py"
    # A module the table does not know counts 60 s.
    assert next_unit(["tests/cluster/test_layouts.py", "tests/cluster/test_new_module.py"], 1,
                     2) == "tests/cluster/test_layouts.py"
    # With no cluster module left for it, a chain's worker takes the other tests.
    assert next_unit(["tests/cluster/test_docs.py", "tests/unit/test_a.py::test_x"], 1, 2) \
        == "tests/unit/test_a.py::test_x"
    assert next_unit(["tests/cluster/test_docs.py", "tests/unit/test_a.py::test_x",
                      "tests/integration/test_matrix.py"], 1, 2) == \
        "tests/integration/test_matrix.py"


def test_other_workers_take_the_costliest_other_unit_first_then_the_queues_order() -> None:
    # The matrix is one unit of ~1,000 s: late in the queue's order it could end the suite.
    assert max(LOCAL_UNIT_SECONDS, key=LOCAL_UNIT_SECONDS.__getitem__) == \
        "tests/integration/test_matrix.py"
    assert next_unit(UNITS, 2, 2) == "tests/integration/test_matrix.py"
    rest = ["tests/unit/test_b.py::test_y", "tests/unit/test_a.py::test_x"]
    assert next_unit(rest, 2, 2) == "tests/unit/test_b.py::test_y"
    searched = ("tests/integration/test_adaptive_sweep.py::"
                "test_bench_search_compares_batches_asynchrony_and_pruning")
    assert next_unit([*rest, searched], 2, 2) == searched


def test_other_workers_never_take_a_cluster_module() -> None:
    assert next_unit(UNITS, 2, 2) == "tests/integration/test_matrix.py"
    assert next_unit(["tests/cluster/test_layouts.py"], 2, 2) is None
    assert next_unit(["tests/cluster/test_layouts.py"], 1, 1) is None  # one chain: gw0's
    assert next_unit([], 0, 2) is None
