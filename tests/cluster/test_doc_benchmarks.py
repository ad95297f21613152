"""The docs' benchmark blocks (``<!-- doc: bench local|cluster: why -->``), run as documented:
the benchmark tier, ``make bench-docs`` (docs/testcluster.md, "Docs that run as tests").

Every benchmark the docs show runs here with the documented arguments — its defaults, not a
test's own — each page's blocks in page order, in one folder that looks like a clone of this
repository, as its reader would run them: ``bench local`` blocks on this machine (no
``SLURM_CONF``: ``cluster=auto`` stays local, where the pages' CPU figures come from),
``bench cluster`` blocks on a login node of the test cluster. They take minutes each (about
45 in all here), so the every-change suite deselects them (tests/conftest.py) and runs the
same benchmarks small (the tests each block's marker names).

Each block's whole output is kept in ``outputs/bench-docs/PAGE-LINE.log`` of the repository
(each command, its output, its exit code and seconds): the run a page's figures are copied
from, and checked against."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc_ddp.testcluster.cluster import TestCluster
from tests import docblocks

pytestmark = [pytest.mark.cluster, pytest.mark.docbench]
KEEP = docblocks.REPO / "outputs" / "bench-docs"
LOCAL = docblocks.runnable("bench", "local")
CLUSTER = docblocks.runnable("bench", "cluster")


def run_page(blocks: list[docblocks.Block], folder: Path, env: dict[str, str]) -> None:
    problems: list[str] = []
    for block in blocks:
        problems += docblocks.check_block(block, folder, env, keep=KEEP)
        if problems:  # the page's later blocks may build on this one
            break
    assert not problems, "\n\n".join(problems)


@pytest.mark.parametrize("page, blocks", LOCAL, ids=[page for page, _ in LOCAL])
def test_local_benchmarks_run_as_documented(page: str, blocks: list[docblocks.Block],
                                            tmp_path: Path) -> None:
    folder = docblocks.checkout(tmp_path / "checkout")
    run_page(blocks, folder, docblocks.environment(folder))


@pytest.mark.parametrize("page, blocks", CLUSTER, ids=[page for page, _ in CLUSTER])
def test_cluster_benchmarks_run_as_documented(page: str, blocks: list[docblocks.Block],
                                              slurm_cluster: TestCluster,
                                              tmp_path: Path) -> None:
    folder = docblocks.checkout(tmp_path / "checkout")
    run_page(blocks, folder, docblocks.environment(folder, slurm_cluster.env()))
