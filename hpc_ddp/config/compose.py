"""Compose a typed, validated :class:`Config` from ``conf/`` and Hydra override strings.

One function serves the CLI, the per-task entry and the Python API, so every path accepts the
same grammar and refuses bad input with the same one-line :class:`UserError`.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping, Sequence
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

from hpc_ddp.config.schema import GROUPS, Config, register_schemas
from hpc_ddp.config.validate import validate
from hpc_ddp.errors import UserError

CONF_ENV = "HPC_DDP_CONF"


def conf_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The config folder: ``$HPC_DDP_CONF`` if set, else ``conf/`` beside the package."""
    environ = os.environ if environ is None else environ
    if environ.get(CONF_ENV):
        return Path(environ[CONF_ENV]).resolve()
    return Path(__file__).resolve().parents[2] / "conf"


def compose(overrides: Sequence[str] = (), config_dir: Path | None = None) -> Config:
    """Compose ``conf/config.yaml`` with ``overrides`` and return the checked Config.

    Raises UserError (one line: key, value, fix) for a typo, a wrong type, an unknown group
    option or an impossible value.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    register_schemas()
    folder = config_dir or conf_dir()
    try:
        with initialize_config_dir(config_dir=str(folder), version_base=None):
            node = hydra_compose("config", overrides=list(overrides))
        _reject_unknown_keys(OmegaConf.to_container(node, resolve=True), Config, "")
        cfg = OmegaConf.to_object(node)
    except (HydraException, OmegaConfBaseException) as exc:
        raise _user_error(exc, overrides) from None
    assert isinstance(cfg, Config)
    return validate(cfg)


def compose_many(override_lists: Sequence[Sequence[str]],
                 config_dir: Path | None = None) -> list[Config]:
    """compose() for many override lists (sweep points), much faster than one by one.

    Hydra composes the defaults tree once per distinct choice of config groups; the other
    overrides are applied to a copy with Hydra's own override logic. Any list this fast path
    cannot take goes through compose() (and raises its UserError).
    """
    import copy

    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:  # Hydra's own override logic (internal in hydra-core 1.3, pinned in pyproject.toml)
        from hydra._internal.config_loader_impl import ConfigLoaderImpl
    except ImportError:
        return [compose(o, config_dir) for o in override_lists]
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    register_schemas()
    folder = config_dir or conf_dir()
    parser = OverridesParser.create()
    bases: dict[tuple[str, ...], Any] = {}
    results: list[Config | None] = []
    with initialize_config_dir(config_dir=str(folder), version_base=None):
        for overrides in override_lists:
            try:
                parsed = parser.parse_overrides(list(overrides))
                choices = tuple(str(o.input_line) for o in parsed if o.key_or_group in GROUPS)
                if choices not in bases:
                    bases[choices] = hydra_compose("config", overrides=list(choices))
                node = copy.deepcopy(bases[choices])
                values = [o for o in parsed if o.key_or_group not in GROUPS]
                ConfigLoaderImpl._apply_overrides_to_config(values, node)
                _reject_unknown_keys(OmegaConf.to_container(node, resolve=True), Config, "")
                cfg = OmegaConf.to_object(node)
                assert isinstance(cfg, Config)
                results.append(validate(cfg))
            except (HydraException, OmegaConfBaseException, UserError):
                results.append(None)  # compose() below says what is wrong, in one line
    return [cfg if cfg is not None else compose(o, config_dir)
            for cfg, o in zip(results, override_lists, strict=True)]


def to_yaml(cfg: Config) -> str:
    """The resolved config as YAML (what run_dir/config.yaml holds).

    Plain dataclass -> dict -> YAML: OmegaConf.structured() costs tens of milliseconds, which
    a 1000-point sweep pays twice per point.
    """
    import dataclasses

    import yaml

    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)  # libyaml's emitter when present
    return str(yaml.dump(dataclasses.asdict(cfg), Dumper=dumper, sort_keys=False))


def from_yaml(text: str) -> Config:
    """Read a config written by :func:`to_yaml` back, checked against the schema."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        node = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.create(text))
        cfg = OmegaConf.to_object(node)
    except OmegaConfBaseException as exc:
        raise _user_error(exc, ()) from None
    assert isinstance(cfg, Config)
    return validate(cfg)


def _reject_unknown_keys(data: Any, schema: Any, prefix: str) -> None:
    """Hydra lets ``+key=value`` add keys to a typed node; we refuse them like typos."""
    if not (is_dataclass(schema) and isinstance(data, dict)):
        return
    known = {f.name: f for f in fields(schema)}
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in known:
            raise _unknown_key(full, value, list(known), prefix)
        sub = _dataclass_of(schema, key)
        if sub is not None:
            _reject_unknown_keys(value, sub, f"{full}.")


def _dataclass_of(schema: Any, key: str) -> Any:
    default = getattr(schema(), key)
    return type(default) if is_dataclass(default) else None


def _unknown_key(full: str, value: Any, known: list[str], prefix: str) -> UserError:
    leaf = full.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(leaf, known, n=1)
    if not known:  # a free-form map (sbatch_extra, nccl.env): new keys need Hydra's "+"
        return UserError(full, value, "is not in this map yet.",
                         f"add it with +{full}=... (Hydra's syntax for a new key).")
    fix = f"did you mean {prefix}{close[0]}?" if close else f"valid keys: {', '.join(known)}."
    return UserError(full, value, "no such key.", fix + " See docs/configuration.md.")


def _user_error(exc: Exception, overrides: Sequence[str]) -> UserError:
    """Turn Hydra/OmegaConf's multi-line errors into one line naming key, value and fix."""
    from hydra.errors import MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    cause = exc.__cause__ or exc
    if isinstance(exc, MissingConfigException):
        group, option = _missing_option(str(exc))
        options = _group_options(group)
        return UserError(group, option, f"no such {group}.", f"use one of {', '.join(options)}.")
    if isinstance(exc, OverrideParseException):
        bad = _unparsable(overrides)
        key, _, value = bad.partition("=")
        return UserError(
            key if value else "override", value or bad,
            f"cannot be parsed ({str(exc).splitlines()[0]}).",
            f"quote the value ({key}='{value}') when it holds brackets, commas, spaces or "
            "quotes; see https://hydra.cc/docs/advanced/override_grammar/basic/."
            if value else "write key=value, e.g. optim.lr=0.01.",
        )
    full_key = getattr(cause, "full_key", None) or ""
    if isinstance(cause, ConfigAttributeError | ConfigKeyError) and full_key:
        prefix, _, leaf = full_key.rpartition(".")
        known = _known_keys(prefix)
        return _unknown_key(full_key, _value_of(full_key, overrides), known,
                            f"{prefix}." if prefix else "")
    if isinstance(cause, ValidationError) and full_key:
        first = str(cause).splitlines()[0]
        return UserError(full_key, _value_of(full_key, overrides), f"{first}.",
                         "see docs/configuration.md for the type of each key.")
    return UserError("config", " ".join(overrides), str(exc).splitlines()[0], "")


def _unparsable(overrides: Sequence[str]) -> str:
    """The first override Hydra's grammar refuses."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    for item in overrides:
        try:
            parser.parse_overrides([item])
        except OverrideParseException:
            return item
    return " ".join(overrides)


def _missing_option(text: str) -> tuple[str, str]:
    # "In 'config': Could not find 'model/foo'" -> ("model", "foo")
    start = text.find("Could not find '") + len("Could not find '")
    path = text[start:text.find("'", start)]
    group, _, option = path.rpartition("/")
    return group or "config", option


def _group_options(group: str) -> list[str]:
    folder = conf_dir() / group
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


def _known_keys(prefix: str) -> list[str]:
    schema: Any = Config
    for part in filter(None, prefix.split(".")):
        sub = _dataclass_of(schema, part) if is_dataclass(schema) else None
        if sub is None:
            return []
        schema = sub
    return [f.name for f in fields(schema)]


def _value_of(full_key: str, overrides: Sequence[str]) -> str:
    for item in overrides:
        key, _, value = item.lstrip("+~").partition("=")
        if key == full_key:
            return value
    return ""


__all__ = ["GROUPS", "compose", "compose_many", "conf_dir", "from_yaml", "to_yaml"]
