"""Overrides as typed: what Hydra would misread or refuse with a long message.

Checked before composing, so each mistake gets one line naming the override and the fix.
"""

from __future__ import annotations

import functools
import re
import typing
from collections.abc import Sequence
from dataclasses import is_dataclass
from typing import Any

from hpc_ddp.config.schema import GROUPS, Config
from hpc_ddp.errors import UserError


def quoted(value: str) -> str:
    """``value`` as an override's value: as it is when Hydra's grammar reads it back
    unchanged, else single-quoted with its quotes escaped (Hydra unescapes only those)."""

    if re.fullmatch(r"[\w./:@+-]+", value):
        return value
    return "'" + value.replace("'", "\\'") + "'"


@functools.cache
def schema_type(key: str) -> Any:
    """The schema's type of a dotted key; None for a map entry, a typo or a group name."""

    hint: Any = Config
    for part in key.split("."):
        if not is_dataclass(hint):
            return None
        hint = typing.get_type_hints(hint).get(part)
        if hint is None:
            return None
    return hint


def hint_has(hint: Any, kind: type) -> bool:
    return hint is kind or typing.get_origin(hint) is kind or any(
        a is kind or typing.get_origin(a) is kind for a in typing.get_args(hint))


def check_overrides(overrides: Sequence[str]) -> None:
    """What Hydra would misread or refuse with a long message: parse errors, a sweep without
    -m, ``~`` on a schema key, a number for a boolean. UserError names the override."""
    # deferred: hydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    from hpc_ddp.config.yaml_guard import check_nesting  # deferred (start-up): yaml_guard

    parser = OverridesParser.create()
    for item in overrides:
        check_nesting(item, "the command line")  # before Hydra's parser recurses into it
        try:
            parsed = parser.parse_overrides([item])
        except OverrideParseException as exc:
            raise parse_error(item, exc, parser) from None
        check_override(parsed[0])


def check_override(override: Any) -> None:
    key, item = override.key_or_group, str(override.input_line)
    if not key:
        raise UserError("override", item, "has no key.", "write key=value, e.g. optim.lr=0.01.")
    if key.split(".")[0] == "hydra":  # composed, not run as a Hydra app: nothing reads them
        raise UserError("override", item, "hydra.* settings have no effect here.",
                        "use run_dir=, sweep.dir= and -m, which hpc_ddp reads itself.")
    hint = schema_type(key)
    if override.is_sweep_override():
        value = item.partition("=")[2]
        if hint_has(hint, list):
            raise UserError(key, value, "is a list key; commas outside brackets make a sweep.",
                            f"write the list in brackets: '{key}=[{value}]' (outer quotes for "
                            "the shell).")
        quote = (f"; quote a string that holds commas: {key}='{value}'"
                 if hint_has(hint, str) else "")
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
    if hint is not None and hint_has(hint, bool) and type(given) is int and given not in (0, 1):
        # OmegaConf reads any integer as a boolean (2 -> true); only 0 and 1 are meant as one.
        raise UserError(key, given, "is a boolean (true/false); of the numbers only 1 and 0 "
                        "are read as one.",
                        f"write {key}=true or {key}=false.")


def parse_error(item: str, exc: Exception, parser: Any) -> UserError:
    """The fix for an override Hydra's grammar refuses: its key, its value or the missing =."""
    from hydra.errors import OverrideParseException  # deferred: hydra

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
        f"quote the value for Hydra and the whole override for the shell "
        f"({shell_quoted(f'{prefix}{key}', value)}) when it holds brackets, commas, spaces, "
        "quotes, ^ or =; see https://hydra.cc/docs/advanced/override_grammar/basic/.")


def shell_quoted(key: str, value: str) -> str:
    """``"key='value'"``: the inner quotes are Hydra's, the outer ones the shell's (which
    would otherwise remove the inner ones); single quotes alone where the value holds a
    character double quotes leave to the shell."""
    if any(c in value for c in "\"$`!\\"):
        return f"{key}='{value}'"
    return f"\"{key}='{value}'\""


def unparsable(overrides: Sequence[str]) -> str:
    """The first override Hydra's grammar refuses."""
    # deferred: hydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    from hpc_ddp.config.yaml_guard import check_nesting  # deferred (start-up): yaml_guard

    parser = OverridesParser.create()
    for item in overrides:
        check_nesting(item, "the command line")  # before Hydra's parser recurses into it
        try:
            parser.parse_overrides([item])
        except OverrideParseException:
            return item
    return " ".join(overrides)
