"""Hydra's and OmegaConf's multi-line errors as one line: the key, the value, the fix."""

from __future__ import annotations

import difflib
import functools
import re
from collections.abc import Sequence
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

from hpc_ddp.config.folders import conf_dir
from hpc_ddp.config.overrides import hint_has, parse_error, schema_type, unparsable
from hpc_ddp.config.schema import FREE_FORM, PARTS, Config
from hpc_ddp.errors import UserError, shown


def reject_unknown_keys(data: Any, schema: Any, prefix: str,
                         overrides: Sequence[str] = ()) -> None:
    """Hydra lets ``+key=value`` add keys to a typed node; we refuse them like typos."""
    if not (is_dataclass(schema) and isinstance(data, dict)):
        return
    known = {f.name: f for f in fields(schema)}
    for key, value in data.items():
        full = f"{prefix}{key}"
        if not prefix and (key in PARTS or key in FREE_FORM):
            continue  # parts are checked by config/parts.py, free-form keys not at all
        if key not in known:
            raise _unknown_key(full, value, list(known), prefix, overrides)
        sub = _dataclass_of(schema, key)
        if sub is not None:
            reject_unknown_keys(value, sub, f"{full}.", overrides)


def _dataclass_of(schema: Any, key: str) -> Any:
    default = getattr(schema(), key)
    return type(default) if is_dataclass(default) else None


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
    meant = closest_key(full, f"{prefix}{close[0]}{rest}" if close else None)
    fix = f"did you mean {meant}?" if meant else f"valid keys: {', '.join(known)}."
    return UserError(full, shown(value), "no such key.", fix + " See docs/configuration.md.")


def closest_key(typed: str, guess: str | None = None) -> str | None:
    """The key a mistyped ``typed`` most likely means, among the keys that exist (every
    group searched): ``guess`` (one level's closest name) if it exists, else the one key
    ``typed`` is the end of (container.image -> cluster.container.image), else the one key
    whose last name is close to typed's (imge_size -> data.image_size), else the closest
    whole key; None when none is close."""
    keys = all_keys()
    if guess in keys:
        return guess
    ends = [k for k in keys if k.endswith(f".{typed}")]
    if len(ends) == 1:
        return ends[0]
    leaves: dict[str, list[str]] = {}
    for key in keys:
        leaves.setdefault(key.rpartition(".")[2], []).append(key)
    leaf = difflib.get_close_matches(typed.rpartition(".")[2], list(leaves), n=1, cutoff=0.8)
    if leaf and len(leaves[leaf[0]]) == 1:  # imge_size -> data.image_size, but not "name"
        return leaves[leaf[0]][0]
    close = difflib.get_close_matches(typed, keys, n=1, cutoff=0.8)
    return close[0] if close else None


@functools.cache
def all_keys() -> tuple[str, ...]:
    """Every key of the config as a dotted path, the nodes that hold keys included
    (cluster, cluster.container, ...; a part's built-in keys, not its `_target_` form)."""
    found: list[str] = []

    def walk(schema: Any, prefix: str) -> None:
        for f in fields(schema):
            if f.name in ("target", "kwargs") and schema in PARTS.values():
                continue
            found.append(f"{prefix}{f.name}")
            sub = _dataclass_of(schema, f.name)
            if sub is not None:
                walk(sub, f"{prefix}{f.name}.")

    walk(Config, "")
    return tuple(found)


def user_error(exc: Exception, overrides: Sequence[str],
                folders: Sequence[Path] = ()) -> UserError:
    """Turn Hydra/OmegaConf's multi-line errors into one line naming key, value and fix."""
    # deferred: hydra, omegaconf
    from hydra.errors import MissingConfigException, OverrideParseException
    from omegaconf import errors

    cause = exc.__cause__ or exc
    text = str(exc)
    if isinstance(exc, MissingConfigException) and "Could not find '" in text:
        group, option = _missing_option(text)
        options = ", ".join(group_options(group, folders))
        return UserError(group, option, f"no such {group}.", f"use one of {options}.")
    if isinstance(exc, OverrideParseException):
        from hydra.core.override_parser.overrides_parser import OverridesParser  # deferred: hydra

        return parse_error(unparsable(overrides), exc, OverridesParser.create())
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
        value, hint, first = _value_of(full_key, overrides), schema_type(full_key), str(cause)
        if "does not support deletion" in first:
            return UserError("override", f"~{full_key}", f"{full_key} is a key of the schema, "
                             "which cannot be deleted.", f"set it instead ({full_key}=<value>).")
        if hint_has(hint, list) and not value.startswith("["):
            fix = f"write a list in brackets: '{full_key}=[{value}]' (outer quotes for the shell)."
        elif hint_has(hint, dict):
            fix = f"set one entry: +{full_key}.<name>=<value>."
        elif "is not Optional" in first:
            fix = f"give {full_key} a value; it cannot be null."
        elif hint_has(hint, bool):
            fix = f"write {full_key}=true or {full_key}=false."
        else:
            fix = "see docs/configuration.md for the type of each key."
        return UserError(full_key, value, f"{first.splitlines()[0].rstrip('.')}.", fix)
    return UserError("config", " ".join(overrides), text.splitlines()[0],
                     "see docs/configuration.md#overrides for the override grammar.")


def _missing_option(text: str) -> tuple[str, str]:
    # "In 'config': Could not find 'model/foo'" -> ("model", "foo")
    start = text.find("Could not find '") + len("Could not find '")
    path = text[start:text.find("'", start)]
    group, _, option = path.rpartition("/")
    return group or "config", option


def group_options(group: str, folders: Sequence[Path] = ()) -> list[str]:
    """The options of a config group over the search folders (default: hpc_ddp's conf/)."""
    if not folders:
        folders = [conf_dir()]
    where = group.replace(".", "/")
    found = {p.stem for folder in folders for p in (folder / where).glob("*.yaml")}
    return sorted(found)


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
