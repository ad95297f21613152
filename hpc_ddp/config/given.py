"""An override's value as the composed config will read it, from the command line alone: the
one reader for what must be known before anything is composed (a remote submit or not, a
resume, a dry run, where the run or the sweep goes).

A plain word or path is read here: the submit command's start pays nothing for Hydra
(~0.2 s to import) just to learn that a run is local. Anything else (quotes, brackets,
escapes, an interpolation, a number other than 0 and 1) goes through Hydra's own override
parser, as ``compose`` reads it. A boolean reads as OmegaConf reads a bool field:
true/false, yes/no, y/n and on/off in any case, 1 and 0 (``check_overrides`` refuses the
other numbers), a quoted number as that number.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

# Hydra reads these unquoted, on their own, as the string they are (a word, a path, a
# host), unless they are a number, a boolean or null (told apart below).
_PLAIN = re.compile(r"[\w./@:+-]+")
# What Hydra's grammar could read as a number (a superset: an int, a float, inf, nan, with
# a sign or underscores): left to Hydra, but for 0 and 1.
_NUMBERISH = re.compile(r"[+-]?([\d_]*\.?[\d_]*([eE][+-]?[\d_]+)?|inf|nan)", re.IGNORECASE)
_BOOLS = {"true": True, "false": False, "yes": True, "no": False, "y": True, "n": False,
          "on": True, "off": False}
_UNPARSED = object()


def typed(overrides: Sequence[str], key: str) -> str | None:
    """The text after ``key=`` in its last override (``+key=`` and ``++key=`` are the same
    key), as typed; None when not given or deleted (``~key``)."""
    found = None
    for item in overrides:
        name, eq, value = item.partition("=")
        if name.lstrip("~+") != key:
            continue
        found = None if name.startswith("~") else (value if eq else None)
    return found


def value(overrides: Sequence[str], key: str) -> Any:
    """``key``'s value as Hydra's parser reads its last override (a bool, an int, a string,
    a list...); None when not given, null, deleted or not an override Hydra can parse
    (``compose`` says why)."""
    text = typed(overrides, key)
    if text is None:
        return None
    quick = _plain(text)
    return _parsed(key, text) if quick is _UNPARSED else quick


def flag(overrides: Sequence[str], key: str) -> bool:
    """``key`` as a bool field of the composed config reads it; False when not given or not
    a boolean (``compose`` refuses such a value with its own message)."""
    return as_bool(value(overrides, key)) is True


def text(overrides: Sequence[str], key: str) -> str | None:
    """``key`` as a string field reads it (quotes taken off, as Hydra does); None when not
    given, null, empty, or not a single value."""
    found = value(overrides, key)
    if found is None or isinstance(found, list | dict) or found == "":
        return None
    return str(found)


def as_bool(found: Any) -> bool | None:
    """A parsed value as OmegaConf's BooleanNode reads it; None where it refuses one."""
    if isinstance(found, bool):
        return found
    if isinstance(found, int):  # OmegaConf reads 2 as true; check_overrides refuses it
        return {0: False, 1: True}.get(found)
    if not isinstance(found, str):
        return None
    try:
        return int(found) != 0  # a quoted number: OmegaConf reads it as that number
    except ValueError:
        return _BOOLS.get(found.lower())


def _plain(text: str) -> Any:
    """What Hydra's parser makes of ``text`` where that is plain to see, else _UNPARSED."""
    if text == "":
        return ""
    if not _PLAIN.fullmatch(text):
        return _UNPARSED
    word = text.lower()
    if word in ("true", "false"):
        return word == "true"
    if word == "null":
        return None
    if text in ("0", "1"):
        return int(text)
    return _UNPARSED if _NUMBERISH.fullmatch(text) else text


def _parsed(key: str, text: str) -> Any:
    """``key=text`` through Hydra's override parser; None where it cannot be parsed."""
    # deferred: hydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        item = OverridesParser.create().parse_overrides([f"{key}={text}"])[0]
    except HydraException:
        return None
    return None if item.is_sweep_override() else item.value()
