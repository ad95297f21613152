"""The docs' `local` blocks, run as a reader would run them (tests/docblocks.py): each page's
blocks in page order, in one folder that looks like a clone of this repository, with the
shown output checked. A page's examples are sized to run in seconds."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import docblocks

PAGES = docblocks.runnable("local")


@pytest.mark.parametrize("page, blocks", PAGES, ids=[page for page, _ in PAGES])
def test_local_blocks_do_what_the_page_shows(page: str, blocks: list[docblocks.Block],
                                             tmp_path: Path) -> None:
    folder = docblocks.checkout(tmp_path / "checkout")
    env = docblocks.environment(folder)
    problems: list[str] = []
    for block in blocks:
        problems += docblocks.check_block(block, folder, env)
        if problems:  # the page's later blocks build on this one
            break
    assert not problems, "\n\n".join(problems)
