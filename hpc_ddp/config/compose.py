"""Compose a typed, validated :class:`Config` from ``conf/`` and Hydra override strings.

One function serves the CLI, the per-task entry and the Python API, so every path accepts the
same grammar and refuses bad input with the same one-line :class:`UserError`.
"""

from __future__ import annotations

import difflib
import functools
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

from hpc_ddp.config.schema import GROUPS, Config, register_schemas
from hpc_ddp.config.validate import validate
from hpc_ddp.errors import UserError, shown

CONF_ENV = "HPC_DDP_CONF"


def conf_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The config folder: ``$HPC_DDP_CONF`` if set, else ``conf/`` beside the package."""
    environ = os.environ if environ is None else environ
    if environ.get(CONF_ENV):
        return Path(environ[CONF_ENV]).resolve()
    return Path(__file__).resolve().parents[2] / "conf"


def check_conf_dir(folder: Path, key: str = CONF_ENV) -> Path:
    """``folder`` if it holds a config.yaml; else UserError naming ``key`` (where it came from)."""
    fix = (f"point {CONF_ENV} at a folder laid out like hpc_ddp's conf/ (config.yaml and one "
           f"folder per group), or unset {CONF_ENV} to use the packaged one.")
    if not folder.is_dir():
        raise UserError(key, str(folder),
                        "is not a folder." if folder.exists() else "does not exist.", fix)
    if not (folder / "config.yaml").is_file():
        raise UserError(key, str(folder), "has no config.yaml.", fix)
    return folder


def _folder(config_dir: Path | None) -> Path:
    if config_dir is not None:
        return check_conf_dir(Path(config_dir), "config_dir")
    return check_conf_dir(conf_dir(), CONF_ENV if os.environ.get(CONF_ENV) else "conf")


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
    folder = _folder(config_dir)
    check_overrides(overrides)
    try:
        with initialize_config_dir(config_dir=str(folder), version_base=None):
            node = hydra_compose("config", overrides=list(overrides))
        _reject_unknown_keys(OmegaConf.to_container(node, resolve=True), Config, "", overrides)
        cfg = OmegaConf.to_object(node)
    except (HydraException, OmegaConfBaseException) as exc:
        raise _user_error(exc, overrides, folder) from None
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
    folder = _folder(config_dir)
    parser = OverridesParser.create()
    bases: dict[tuple[str, ...], Any] = {}
    results: list[Config | None] = []
    with initialize_config_dir(config_dir=str(folder), version_base=None):
        for overrides in override_lists:
            try:
                parsed = parser.parse_overrides(list(overrides))
                for override in parsed:
                    _check_override(override)
                choices = tuple(str(o.input_line) for o in parsed if o.key_or_group in GROUPS)
                if choices not in bases:
                    bases[choices] = hydra_compose("config", overrides=list(choices))
                node = copy.deepcopy(bases[choices])
                values = [o for o in parsed if o.key_or_group not in GROUPS]
                ConfigLoaderImpl._apply_overrides_to_config(values, node)
                _reject_unknown_keys(OmegaConf.to_container(node, resolve=True), Config, "",
                                     overrides)
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


def _reject_unknown_keys(data: Any, schema: Any, prefix: str,
                         overrides: Sequence[str] = ()) -> None:
    """Hydra lets ``+key=value`` add keys to a typed node; we refuse them like typos."""
    if not (is_dataclass(schema) and isinstance(data, dict)):
        return
    known = {f.name: f for f in fields(schema)}
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in known:
            raise _unknown_key(full, value, list(known), prefix, overrides)
        sub = _dataclass_of(schema, key)
        if sub is not None:
            _reject_unknown_keys(value, sub, f"{full}.", overrides)


def _dataclass_of(schema: Any, key: str) -> Any:
    default = getattr(schema(), key)
    return type(default) if is_dataclass(default) else None


@functools.cache
def _schema_type(key: str) -> Any:
    """The schema's type of a dotted key; None for a map entry, a typo or a group name."""
    import typing

    hint: Any = Config
    for part in key.split("."):
        if not is_dataclass(hint):
            return None
        hint = typing.get_type_hints(hint).get(part)
        if hint is None:
            return None
    return hint


def _has(hint: Any, kind: type) -> bool:
    import typing

    return hint is kind or typing.get_origin(hint) is kind or any(
        a is kind or typing.get_origin(a) is kind for a in typing.get_args(hint))


def _unknown_key(full: str, value: Any, known: list[str], prefix: str,
                 overrides: Sequence[str] = ()) -> UserError:
    leaf = full.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(leaf, known, n=1)
    if not known:  # a free-form map (sbatch_extra, nccl.env): new keys need Hydra's "+"
        return UserError(full, shown(value), "is not in this map yet.",
                         f"add it with +{full}=... (Hydra's syntax for a new key).")
    # Show the override as typed (optimm.lr=0.1), not only the unknown part of it (optimm).
    typed = next((o.lstrip("+~").partition("=") for o in overrides
                  if o.lstrip("+~").partition("=")[0].startswith(f"{full}.")), None)
    rest = typed[0][len(full):] if typed else ""
    if typed:
        full, value = typed[0], typed[2]
    fix = f"did you mean {prefix}{close[0]}{rest}?" if close else f"valid keys: {', '.join(known)}."
    return UserError(full, shown(value), "no such key.", fix + " See docs/configuration.md.")


def check_overrides(overrides: Sequence[str]) -> None:
    """What Hydra would misread or refuse with a long message: parse errors, a sweep without
    -m, ``~`` on a schema key, a number for a boolean. UserError names the override."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    for item in overrides:
        try:
            parsed = parser.parse_overrides([item])
        except OverrideParseException as exc:
            raise _parse_error(item, exc, parser) from None
        _check_override(parsed[0])


def _check_override(override: Any) -> None:
    key, item = override.key_or_group, str(override.input_line)
    if not key:
        raise UserError("override", item, "has no key.", "write key=value, e.g. optim.lr=0.01.")
    if key.split(".")[0] == "hydra":  # composed, not run as a Hydra app: nothing reads them
        raise UserError("override", item, "hydra.* settings have no effect here.",
                        "use run_dir=, sweep.dir= and -m, which hpc_ddp reads itself.")
    hint = _schema_type(key)
    if override.is_sweep_override():
        value = item.partition("=")[2]
        if _has(hint, list):
            raise UserError(key, value, "is a list key; commas outside brackets make a sweep.",
                            f"write the list in brackets: '{key}=[{value}]' (outer quotes for "
                            "the shell).")
        quote = f"; quote a string that holds commas: {key}='{value}'" if _has(hint, str) else ""
        raise UserError(key, value, "is a sweep (several values); a single run takes one.",
                        f"add -m to run one job per value (python -m hpc_ddp.submit -m {item}), "
                        f"or give one value{quote}.")
    if override.is_delete() and key in GROUPS:
        raise UserError("override", item, f"`~` deletes; the {key} group cannot be removed.",
                        f"choose one of its options instead: {key}=<option> (conf/{key}/).")
    if override.is_delete() and hint is not None:
        raise UserError("override", item, f"`~` deletes a key, and {key} is a key of the "
                        "schema, which cannot be deleted.", f"set it instead ({key}=<value>, or "
                        f"{key}=null where null is allowed); `~` removes only entries of "
                        "cluster.sbatch_extra, nccl.env and nccl.extra_env.")
    given = None if override.is_delete() else override.value()
    if hint is not None and _has(hint, bool) and type(given) is int and given not in (0, 1):
        # OmegaConf reads any integer as a boolean (2 -> true); only 0 and 1 are meant as one.
        raise UserError(key, given, "is a boolean (true/false); of the numbers only 1 and 0 "
                        "are read as one.",
                        f"write {key}=true or {key}=false.")


def _parse_error(item: str, exc: Exception, parser: Any) -> UserError:
    """The fix for an override Hydra's grammar refuses: its key, its value or the missing =."""
    from hydra.errors import OverrideParseException

    prefix = item[:len(item) - len(item.lstrip("+~"))]
    key, eq, value = item[len(prefix):].partition("=")
    if not eq and not prefix.startswith("~"):
        return UserError("override", item, "cannot be parsed (no =).",
                         "write key=value, e.g. optim.lr=0.01; a value with spaces is one "
                         "argument, quoted whole: 'cluster.setup=[module load cuda]'.")
    try:
        parser.parse_overrides([f"{prefix}{key}=x"])
    except OverrideParseException:
        if key.startswith(("nccl.env.", "nccl.extra_env.")):
            problem, fix = ("is not an environment variable name.", "use letters, digits and _, "
                            "not starting with a digit, e.g. +nccl.env.NCCL_DEBUG=INFO.")
        elif key.startswith("cluster.sbatch_extra."):
            problem, fix = ("is not an sbatch option name.",
                            "use the long option name, e.g. +cluster.sbatch_extra.mail-type=END.")
        else:
            problem, fix = ("the key cannot be parsed (keys are dotted names of letters, "
                            "digits, _ and -).", "check the spelling; see docs/configuration.md.")
        return UserError(f"{prefix}{key}", value, problem, fix)
    items = value.split(",")
    if len(items) > 1 and not value.startswith(("[", "{", "'", '"')) and "" in items:
        single = ",".join(i for i in items if i)
        return UserError(f"{prefix}{key}", value, "has an empty item between commas.",
                         f"drop the extra comma: {prefix}{key}={single} (a sweep, with -m); "
                         f"quote a string that holds commas: {prefix}{key}='{value}'.")
    return UserError(
        f"{prefix}{key}", value, f"cannot be parsed ({str(exc).splitlines()[0]}).",
        f"quote the value ({prefix}{key}='{value}') when it holds brackets, commas, spaces or "
        "quotes; see https://hydra.cc/docs/advanced/override_grammar/basic/.")


def _user_error(exc: Exception, overrides: Sequence[str],
                folder: Path | None = None) -> UserError:
    """Turn Hydra/OmegaConf's multi-line errors into one line naming key, value and fix."""
    from hydra.errors import MissingConfigException, OverrideParseException
    from omegaconf import errors

    cause = exc.__cause__ or exc
    text = str(exc)
    if isinstance(exc, MissingConfigException) and "Could not find '" in text:
        group, option = _missing_option(text)
        options = ", ".join(_group_options(group, folder or conf_dir()))
        return UserError(group, option, f"no such {group}.", f"use one of {options}.")
    if isinstance(exc, OverrideParseException):
        from hydra.core.override_parser.overrides_parser import OverridesParser

        return _parse_error(_unparsable(overrides), exc, OverridesParser.create())
    named = re.search(r"(append to|delete from) config\. (?:An item is already at )?'([^']+)'"
                      r"(\.| does not exist)", text)
    if named and named.group(1) == "append to":
        key = named.group(2)
        value = _value_of(key, overrides)
        return UserError(f"+{key}", value, f"{key} exists already; + only adds new keys.",
                         f"use {key}={value} to set it (or ++{key}={value}: set or add).")
    if named:
        return UserError("override", f"~{named.group(2)}", "is not set, so `~` has nothing to "
                         "delete.", "drop this override; --cfg shows what is set.")
    full_key = re.sub(r"\[\d+\]$", "", getattr(cause, "full_key", None) or "")
    if isinstance(cause, errors.ConfigAttributeError | errors.ConfigKeyError) and full_key:
        prefix, _, leaf = full_key.rpartition(".")
        known = _known_keys(prefix)
        return _unknown_key(full_key, _value_of(full_key, overrides), known,
                            f"{prefix}." if prefix else "", overrides)
    if isinstance(cause, errors.ValidationError | errors.ConfigTypeError) and full_key:
        value, hint, first = _value_of(full_key, overrides), _schema_type(full_key), str(cause)
        if "does not support deletion" in first:
            return UserError("override", f"~{full_key}", f"{full_key} is a key of the schema, "
                             "which cannot be deleted.", f"set it instead ({full_key}=<value>).")
        if _has(hint, list) and not value.startswith("["):
            fix = f"write a list in brackets: '{full_key}=[{value}]' (outer quotes for the shell)."
        elif _has(hint, dict):
            fix = f"set one entry: +{full_key}.<name>=<value>."
        elif "is not Optional" in first:
            fix = f"give {full_key} a value; it cannot be null."
        elif _has(hint, bool):
            fix = f"write {full_key}=true or {full_key}=false."
        else:
            fix = "see docs/configuration.md for the type of each key."
        return UserError(full_key, value, f"{first.splitlines()[0].rstrip('.')}.", fix)
    return UserError("config", " ".join(overrides), text.splitlines()[0],
                     "see docs/configuration.md#overrides for the override grammar.")


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


def _group_options(group: str, folder: Path) -> list[str]:
    where = folder / group
    return sorted(p.stem for p in where.glob("*.yaml")) if where.is_dir() else []


def _known_keys(prefix: str) -> list[str]:
    schema: Any = Config
    for part in filter(None, prefix.split(".")):
        sub = _dataclass_of(schema, part) if is_dataclass(schema) else None
        if sub is None:
            return []
        schema = sub
    return [f.name for f in fields(schema)]


def _value_of(full_key: str, overrides: Sequence[str]) -> str:
    for item in reversed(overrides):  # the last one wins, as in Hydra
        key, _, value = item.lstrip("+~").partition("=")
        if key == full_key:
            return value
    return ""


__all__ = ["GROUPS", "check_conf_dir", "check_overrides", "compose", "compose_many", "conf_dir",
           "from_yaml", "to_yaml"]
