"""The launch targets behind one seam (launch/target.py): every target module provides the
Protocol's functions with its parameters, and an unknown kind is named with the known ones."""

from __future__ import annotations

import importlib
import inspect

import pytest

from hpc_ddp.launch.target import TARGETS, LaunchTarget, target


def _parameters(fn: object) -> list[str]:
    return [p for p in inspect.signature(fn).parameters if p != "self"]  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", sorted(TARGETS))
def test_every_target_provides_the_protocol(kind: str) -> None:
    module = importlib.import_module(TARGETS[kind])
    assert target(kind) is module
    for name in ("submit", "describe", "dry_run"):
        wanted = _parameters(getattr(LaunchTarget, name))
        given = _parameters(getattr(module, name))
        assert given[:len(wanted)] == wanted, (kind, name, given)
        extra = inspect.signature(getattr(module, name)).parameters
        assert all(extra[p].default is not inspect.Parameter.empty
                   for p in given[len(wanted):]), (kind, name)  # extras are optional


def test_every_kind_the_config_accepts_has_a_target() -> None:
    from hpc_ddp.config.validate import CLUSTER_KINDS

    assert set(CLUSTER_KINDS) - {"auto"} == set(TARGETS)  # auto resolves to one of them


def test_an_unknown_kind_is_named_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match="cluster.kind='pbs' has no launch target; known: local"):
        target("pbs")
