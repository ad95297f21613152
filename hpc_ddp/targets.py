"""Import and call a user's code named in the config: `_target_` parts and entry functions.

Every failure is a one-line :class:`TargetError` (a :class:`UserError`) naming the config key,
the value and the fix: a module that is not importable, a name the module lacks, an argument
the callable does not take (with the closest one it does), or an exception it raised. The
same code runs on the submit host (before anything is submitted) and on every rank (where a
node whose environment differs fails with the same message, its rank and host added).
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import pkgutil
from collections.abc import Callable, Mapping
from typing import Any

from hpc_ddp.errors import UserError

HYDRA_KEYS = ("_partial_", "_args_", "_recursive_", "_convert_")
_IMPORTABLE_FIX = ("check the spelling; the module must be importable where the job runs "
                   "(run from your project folder, or pip install -e it)")


class TargetError(UserError):
    """A user's callable named in the config cannot be imported, called, or used."""


def locate(path: str, key: str) -> Any:
    """The object at ``path`` ("pkg.mod.Name", or "pkg.mod:name.attr")."""
    module_path, colon, rest = path.partition(":")
    if not colon:
        module_path, rest = _split_module(path, key)
    try:
        obj: Any = importlib.import_module(module_path)
    except ImportError as exc:
        whole = path.replace(":", ".")  # a correction is judged on everything typed
        near = closest_module(getattr(exc, "name", None) or "", whole)
        hint = ""
        if near:  # the corrected module, then the rest as typed (its colon kept)
            module = near[:len(module_path) + len(near) - len(whole)]
            hint = f"did you mean {module}{path[len(module_path):]}?"
        raise TargetError(key, path, f"cannot be imported ({_first_line(exc)}).",
                          _fix(hint)) from None
    except Exception as exc:  # the module raised while importing
        raise TargetError(key, path, f"importing {module_path} raised "
                          f"{type(exc).__name__}: {_first_line(exc)}.",
                          f"fix the error in {module_path}.") from None
    done = module_path
    # The hint in the form typed: pkg.mod:main (an entry's colon) or pkg.mod.Name.
    sep = ":" if colon else "."
    names_typed = list(filter(None, rest.split(".")))
    for at, name in enumerate(names_typed):
        if not hasattr(obj, name):
            raise TargetError(key, path, f"{done} has no {_member(obj)} {name}.",
                              _fix(_closest_member(obj, name, done, sep,
                                                   names_typed[at + 1:])))
        obj = getattr(obj, name)
        done, sep = f"{done}{sep}{name}", "."
    return obj


def _fix(hint: str) -> str:
    """The Fix of a name that cannot be found: the suggestion, then the usual advice as a
    sentence of its own."""
    if not hint:
        return f"{_IMPORTABLE_FIX}."
    return f"{hint} {_IMPORTABLE_FIX[0].upper()}{_IMPORTABLE_FIX[1:]}."


def _member(obj: Any) -> str:
    return "module or attribute" if hasattr(obj, "__path__") else "attribute"


def _closest_member(obj: Any, name: str, done: str, sep: str, after: list[str]) -> str:
    """"did you mean pkg.nets.Net?" for pkg.nte.Net: the closest attribute of ``obj`` or,
    in a package, the closest of its modules (a module not imported yet is no attribute),
    with the rest as typed; "" when nothing is close."""
    names = [n for n in dir(obj) if not n.startswith("_")]
    if hasattr(obj, "__path__"):
        names += [m.name for m in pkgutil.iter_modules(obj.__path__)]
    close = difflib.get_close_matches(name, sorted(set(names)), n=3)
    if not close:
        return ""
    tail = "".join(f".{n}" for n in after)
    # The one of the closest under which the rest is found (mypkg.nets.Net, not mypkg.net).
    found = next((c for c in close if _resolves(f"{done}.{c}{tail}")), close[0])
    return f"did you mean {done}{sep}{found}{tail}?"


def _resolves(path: str) -> bool:
    try:
        module, rest = _split_module(path, "")
        obj = importlib.import_module(module)
        for name in filter(None, rest.split(".")):
            obj = getattr(obj, name)
    except Exception:  # anything that does not import or is not there
        return False
    return True


def _split_module(path: str, key: str) -> tuple[str, str]:
    """("pkg.mod", "Name") for "pkg.mod.Name": the longest importable prefix."""
    parts = path.split(".")
    if not all(p.isidentifier() for p in parts):
        raise TargetError(key, path, "is not a dotted import path.",
                          "write the full name, e.g. my_pkg.models.Net.")
    for cut in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:cut])
        if has_module(module):
            return module, ".".join(parts[cut:])
    return parts[0], ".".join(parts[1:])  # import_module names what is missing


def closest_module(missing: str, module_path: str) -> str | None:
    """``module_path`` with its missing part (``missing``: ImportError.name, e.g. my_pkg.nett)
    replaced by the closest module that exists beside it (my_pkg.net); None when none is
    close, or the missing module is not a part of ``module_path`` (an import inside it)."""
    if not missing or not (module_path == missing or module_path.startswith(missing + ".")):
        return None
    parent, _, name = missing.rpartition(".")
    try:
        where = importlib.import_module(parent).__path__ if parent else None
    except Exception:  # a parent that does not import: no list to look in
        return None
    names = [m.name for m in pkgutil.iter_modules(where)]
    paths = [f"{parent + '.' if parent else ''}{close}{module_path[len(missing):]}"
             for close in difflib.get_close_matches(name, names, n=3)]
    # The one of the closest names under which most of the path imports (testz.usercode:
    # tests.usercode, not the standard library's test).
    return max(paths, key=_importable_depth, default=None)


def _importable_depth(path: str) -> int:
    """How many leading parts of ``path`` name modules that exist (tests.usercode.x: 2)."""
    parts = path.split(".")
    depth = 0
    while depth < len(parts) and has_module(".".join(parts[:depth + 1])):
        depth += 1
    return depth


def has_module(name: str) -> bool:

    try:
        return importlib.util.find_spec(name) is not None
    except Exception:  # a parent package that fails to import: import_module says why
        return False


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def accepts(fn: Any, name: str) -> bool:
    """Whether ``fn`` takes a keyword argument ``name`` (or any, through **kwargs)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name and p.kind != p.VAR_POSITIONAL or p.kind == p.VAR_KEYWORD
               for p in params)


def check_arguments(fn: Any, kwargs: Mapping[str, Any], key: str, path: str,
                    complete: bool) -> None:
    """TargetError when ``fn`` does not take ``kwargs`` (``complete``: nor misses one)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin without a signature: the call will tell
    try:
        (signature.bind if complete else signature.bind_partial)(**kwargs)
    except TypeError as exc:
        names = [p for p in signature.parameters if p not in ("self", "args", "kwargs")]
        bad = next((k for k in kwargs if k not in signature.parameters), None)
        if bad is not None and not any(p.kind == p.VAR_KEYWORD
                                       for p in signature.parameters.values()):
            close = difflib.get_close_matches(bad, names, n=1)
            hint = f"did you mean {key.rpartition('.')[0]}.{close[0]}? " if close else ""
            raise TargetError(f"{key.rpartition('.')[0]}.{bad}", kwargs[bad],
                              f"{path} takes no argument {bad}.",
                              f"{hint}It takes: {', '.join(names) or 'none'}.") from None
        raise TargetError(key, path, f"cannot be called with these arguments ({exc}).",
                          f"it takes: {', '.join(names) or 'none'}; set the missing ones "
                          f"under {key.rpartition('.')[0]}.") from None


def build(part: str, target: str, kwargs: Mapping[str, Any], given: Mapping[str, Any] | None = None,
          auto: Mapping[str, Any] | None = None, partial: bool = False) -> Any:
    """Build a `_target_` part with Hydra's instantiate.

    ``given``: arguments the caller always passes (an optimizer's params); ``auto``: passed
    only where the callable takes them and the config leaves them unset (a model's
    num_classes from the data). ``partial``: return the callable bound to the config's
    arguments instead of calling it (also when the node says ``_partial_: true``, and for a
    plain function that would otherwise be called without its data, such as a loss).
    """
    from hydra.utils import instantiate  # deferred: hydra

    key = f"{part}._target_"
    given, auto = dict(given or {}), dict(auto or {})
    fn = locate(target, key)
    plain = {k: v for k, v in kwargs.items() if k not in HYDRA_KEYS}
    extra = {k: v for k, v in auto.items() if plain.get(k) is None and accepts(fn, k)}
    is_partial = partial or bool(kwargs.get("_partial_"))
    check_arguments(fn, {**plain, **extra, **given}, key, target,
                    complete=not is_partial and not kwargs.get("_args_"))
    node = {"_target_": target, "_convert_": "all", **kwargs, **extra}
    if is_partial:
        node["_partial_"] = True
    try:
        made = instantiate(node, **given)
    except Exception as exc:
        cause = exc.__cause__ or exc
        if isinstance(cause, UserError):  # already one line with its own fix (model=timm)
            raise cause from None
        raise TargetError(key, target, f"raised {type(cause).__name__}: {_first_line(cause)}.",
                          f"check the arguments under {part} (--cfg shows them) and "
                          f"{target} itself.") from exc
    return made


def call_safely(fn: Callable[..., Any], key: str, path: str, *args: Any) -> Any:
    """``fn(*args)``, an exception turned into a TargetError naming ``key``."""
    try:
        return fn(*args)
    except UserError:
        raise
    except Exception as exc:
        raise TargetError(key, path, f"raised {type(exc).__name__}: {_first_line(exc)}.",
                          f"fix {path}, or its arguments under {key.partition('.')[0]}.") from exc
