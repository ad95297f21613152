"""Fixtures for tests that run against the real namespaced Slurm test cluster.

``slurm_cluster`` (session) starts the cluster once, or reuses a healthy one, and stops it at
the end of the session (``HPC_DDP_TESTCLUSTER_KEEP=1`` keeps it running for the next one).
Under pytest-xdist each worker that runs cluster modules has a cluster of its own (gw0 the
default one, gw1 instance 1, nodes bnode1..: tests/conftest.py's chains), so a test takes
its node names from ``slurm_cluster``, never spells them.
Without root or the Slurm packages the tests are skipped with the fix, except under
``CI=true``, where a skip would hide that nothing was tested: there they fail.
"""

from __future__ import annotations

import os
from collections.abc import Generator, Iterator

import pytest

from hpc_ddp.config.secrets import exported
from hpc_ddp.testcluster import settle
from hpc_ddp.testcluster.cluster import (
    TestCluster,
    TestClusterError,
    requirements_missing,
)
from tests.conftest import cluster_instance

KEEP_ENV = "HPC_DDP_TESTCLUSTER_KEEP"
# Set once the session's cluster exists, so that the failure hook can print its logs.
_CLUSTER: TestCluster | None = None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "cluster: runs against the real namespaced Slurm test cluster (tests/cluster)"
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    # A failing cluster test is usually explained by a daemon log, not by the assertion.
    # (This conftest only applies to tests/cluster, so every test here qualifies.)
    if report.failed and report.when == "call" and _CLUSTER is not None:
        report.sections.append(("Slurm daemon logs (tails)", _CLUSTER.logs_tail(40)))
    return report


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[TestCluster]:
    """The running test cluster; its client environment is set in os.environ meanwhile."""
    global _CLUSTER
    problem = requirements_missing()
    if problem:
        msg = (
            f"the Slurm test cluster cannot run here: {problem}. Run these tests as root "
            "(e.g. `sudo .venv/bin/pytest tests/cluster`) on Debian/Ubuntu with the packages "
            "installed; see docs/testcluster.md."
        )
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg)
    cluster = TestCluster(instance=cluster_instance(os.environ.get("PYTEST_XDIST_WORKER")),
                          say=print)
    try:
        cluster.up()
    except TestClusterError as e:
        pytest.fail(f"the Slurm test cluster did not come up:\n{e}", pytrace=False)
    _CLUSTER = cluster
    # Clients started by the tests (and by submitit inside them) find the cluster this way.
    try:
        with exported(cluster.env()):
            yield cluster
    finally:
        _CLUSTER = None
        if os.environ.get(KEEP_ENV) != "1":
            cluster.down()


@pytest.fixture(autouse=True)
def _cluster_left_settled(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test on the cluster: the queue empty and the nodes idle again, or the test
    errors naming what it left (cancelled and resumed, so that the next test starts clean
    instead of waiting for nodes it cannot have)."""
    yield
    if _CLUSTER is None or "slurm_cluster" not in request.fixturenames:
        return
    left = settle.settle(_CLUSTER.env(), _CLUSTER.node_names)
    if left:
        pytest.fail("the test left the cluster unsettled: " + "; ".join(left), pytrace=False)


@pytest.fixture
def slurm_env(slurm_cluster: TestCluster) -> dict[str, str]:
    """The full environment for a Slurm client subprocess (os.environ + SLURM_CONF)."""
    return {**os.environ, **slurm_cluster.env()}


@pytest.fixture
def node_names(slurm_cluster: TestCluster) -> list[str]:
    """The cluster's node names in order (node1.. on the default cluster, bnode1.. on the
    second one): a test spells none."""
    return slurm_cluster.node_names
