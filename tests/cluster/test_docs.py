"""The docs' `cluster` blocks, run against the test cluster as a reader would run them on a
login node (tests/docblocks.py): each page's blocks in page order, in one folder that looks
like a clone of this repository, with SLURM_CONF set, so cluster=auto finds the cluster."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc_ddp.testcluster.cluster import TestCluster
from tests import docblocks

PAGES = docblocks.runnable("cluster")
pytestmark = pytest.mark.cluster


@pytest.mark.parametrize("page, blocks", PAGES, ids=[page for page, _ in PAGES])
def test_cluster_blocks_do_what_the_page_shows(page: str, blocks: list[docblocks.Block],
                                               slurm_cluster: TestCluster,
                                               tmp_path: Path) -> None:
    folder = docblocks.checkout(tmp_path / "checkout")
    env = docblocks.environment(folder, slurm_cluster.env())
    problems: list[str] = []
    for block in blocks:
        problems += docblocks.check_block(block, folder, env)
        if problems:
            break
    assert not problems, "\n\n".join(problems)
