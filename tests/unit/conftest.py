"""Fixtures the unit tests share."""

from tests.unit.one_rank import one_rank_group

__all__ = ["one_rank_group"]
