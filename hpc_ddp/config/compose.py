"""Compose a typed, validated :class:`Config` from ``conf/`` and Hydra override strings.

One function serves the CLI, the per-task entry and the Python API, so every path accepts the
same grammar and refuses bad input with the same one-line :class:`UserError`. A user's config
folder (``config_dir``) is searched before hpc_ddp's own.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import pickle
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from hpc_ddp.config import parts, yaml_guard
from hpc_ddp.config.folders import CONF_ENV, conf_dir
from hpc_ddp.config.given import text, typed
from hpc_ddp.config.messages import reject_unknown_keys, user_error
from hpc_ddp.config.overrides import check_override, check_overrides, quoted
from hpc_ddp.config.schema import FREE_FORM, GROUPS, PARTS, Config, compose_schema, register_schemas
from hpc_ddp.config.secrets import references_kept
from hpc_ddp.config.validate import validate
from hpc_ddp.errors import PointError, UserError
from hpc_ddp.redact import Marks

# A user's config folder for commands that take no --config-dir (srun entries in sbatch files).
CONFIG_DIR_ENV = "HPC_DDP_CONFIG_DIR"


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


def user_config_dir(overrides: Sequence[str], config_dir: Path | str | None = None,
                    environ: Mapping[str, str] | None = None) -> Path | None:
    """The user's config folder: ``config_dir`` given, else the last ``config_dir=`` override,
    else ``$HPC_DDP_CONFIG_DIR``; absolute, checked to be a folder (UserError otherwise)."""
    environ = os.environ if environ is None else environ
    key, given = "config_dir", config_dir
    if typed(overrides, "config_dir"):  # null given: no folder, not $HPC_DDP_CONFIG_DIR's
        given = text(overrides, "config_dir") or ""
    if given is None and environ.get(CONFIG_DIR_ENV):
        key, given = CONFIG_DIR_ENV, environ[CONFIG_DIR_ENV]
    if given is None or str(given) in ("", "null"):
        return None
    folder = Path(given).expanduser().absolute()
    if not folder.is_dir():
        raise UserError(key, str(given), "is not a folder." if folder.exists() else
                        "does not exist.", "give the folder that holds your config groups "
                        "(e.g. conf/ with model/mynet.yaml), relative to here or absolute.")
    return folder


def search_folders(user: Path | None) -> list[Path]:
    """Where group options are looked up, first match wins: the user's folder, then ours."""
    return [*([user] if user else []), _folder()]


def _folder() -> Path:
    return check_conf_dir(conf_dir(), CONF_ENV if os.environ.get(CONF_ENV) else "conf")


@contextlib.contextmanager
def _hydra(user: Path | None) -> Iterator[None]:
    """Hydra initialised on hpc_ddp's conf/, with ``user`` searched before it."""
    # deferred: hydra
    from hydra import initialize_config_dir

    folder = _folder()
    if user is None:
        with initialize_config_dir(config_dir=str(folder), version_base=None):
            yield
        return
    try:  # Hydra's own search-path type (internal in hydra-core 1.3, pinned in pyproject.toml)
        # optional: hydra
        from hydra import version
        from hydra._internal.hydra import Hydra
        from hydra._internal.utils import create_config_search_path
        from hydra.initialize import get_gh_backup, restore_gh_from_backup
    except ImportError:  # a later Hydra: search the user's folder after ours instead
        with initialize_config_dir(config_dir=str(folder), version_base=None):
            yield
        return
    backup = get_gh_backup()
    version.setbase(None)
    search = create_config_search_path(str(folder))
    # Before "main" (hpc_ddp's conf/): a user's model/mynet.yaml, or a config.yaml of theirs.
    search.prepend("hpc_ddp config_dir", f"file://{user}", anchor="main")
    Hydra.create_main_hydra2(task_name="app", config_search_path=search)
    try:
        yield
    finally:
        restore_gh_from_backup(backup)


def compose(overrides: Sequence[str] = (), config_dir: Path | str | None = None) -> Config:
    """Compose ``conf/config.yaml`` with ``overrides`` and return the checked Config.

    ``config_dir``: the user's config folder (else a ``config_dir=`` override, else
    ``$HPC_DDP_CONFIG_DIR``). Raises UserError (one line: key, value, fix) for a typo, a
    wrong type, an unknown group option or an impossible value.
    """
    # deferred: hydra, omegaconf
    from hydra import compose as hydra_compose
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    register_schemas()
    user = user_config_dir(overrides, config_dir)
    check_overrides(overrides)
    check_yaml_folders(user)
    try:
        with _hydra(user), references_kept():
            node = hydra_compose("config", overrides=_for_hydra(overrides, user))
            with references_kept(marks_in(node)):  # a reference of a marked name stays too
                return _finish(node, overrides)
    except (HydraException, OmegaConfBaseException) as exc:
        raise user_error(exc, overrides, search_folders(user)) from None


def marks_in(node: Any) -> Marks:
    """secrets.secret / secrets.public of a composed node, before it is resolved."""
    # deferred: omegaconf
    from omegaconf import OmegaConf

    found = OmegaConf.select(node, "secrets", default=None)
    data = OmegaConf.to_container(found, resolve=False) if found is not None else {}
    data = data if isinstance(data, dict) else {}
    return Marks.of(map(str, data.get("secret") or ()), map(str, data.get("public") or ()))


def check_yaml_folders(user: Path | None) -> None:
    """The YAML of the user's config folder (and of $HPC_DDP_CONF's), aliases counted before
    Hydra builds any of it (config/yaml_guard.py)."""
    for folder in (user, conf_dir() if os.environ.get(CONF_ENV) else None):
        if folder is not None:
            yaml_guard.check_folder(folder)


def _for_hydra(overrides: Sequence[str], user: Path | None) -> list[str]:
    """What Hydra is given: part keys widened (parts.widen_overrides), config_dir absolute."""
    widened = parts.widen_overrides(overrides)
    kept = [o for o in widened if o.lstrip("+").partition("=")[0] != "config_dir"]
    return [*kept, f"config_dir={quoted(str(user))}"] if user else kept


def _finish(node: Any, overrides: Sequence[str], whole: bool = True) -> Config:
    """The composed node -> the typed, validated Config (parts typed by config/parts.py).

    Keys no schema knows (a typo in a YAML file, a `+key=` override) are refused; ``whole=False``
    (sweep points built on a base already checked whole) checks only what `+` overrides add.
    """
    # deferred: omegaconf
    from omegaconf import OmegaConf

    loose = OmegaConf.to_object(node)
    if whole:
        reject_unknown_keys(OmegaConf.to_container(node, resolve=False), Config, "", overrides)
    else:  # the whole tree costs 3 ms a point; only `+` adds what struct mode lets through
        for top in {o.lstrip("+").partition(".")[0].partition("=")[0] for o in overrides
                    if o.startswith("+")}:
            added = OmegaConf.to_container(node[top], resolve=False) if top in node else None
            reject_unknown_keys({top: added}, Config, "", overrides)
    return _assemble(loose, {name: getattr(loose, name) for name in (*PARTS, *FREE_FORM)})


def _assemble(loose: Any, data: dict[str, Any]) -> Config:
    values = {f.name: getattr(loose, f.name) for f in fields(Config)
              if f.name not in PARTS and f.name not in FREE_FORM}
    for name in PARTS:
        values[name] = parts.to_typed(name, data.get(name))
    for name in FREE_FORM:
        values[name] = dict(data.get(name) or {})
    return validate(Config(**values))


def compose_many(override_lists: Sequence[Sequence[str]],
                 config_dir: Path | str | None = None) -> list[Config]:
    """compose() for many override lists (sweep points), much faster than one by one.

    Hydra composes the defaults tree once per distinct choice of config groups; the other
    overrides are applied to a copy with Hydra's own override logic; each distinct override
    is parsed once (the grammar costs ~0.5 ms an override, the points share most of theirs).
    A list this fast path cannot take goes through compose(); a bad list raises PointError
    (its UserError, with its index in ``override_lists``) at once.
    """
    if len(override_lists) == 1:  # one run: compose() itself, nothing to share
        return [_one(0, override_lists[0], config_dir)]
    # deferred: hydra, omegaconf
    from hydra import compose as hydra_compose
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    try:  # Hydra's own override logic (internal in hydra-core 1.3, pinned in pyproject.toml)
        # optional: hydra
        from hydra._internal.config_loader_impl import ConfigLoaderImpl
    except ImportError:
        return [_one(i, o, config_dir) for i, o in enumerate(override_lists)]
    # deferred: hydra, omegaconf
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    register_schemas()
    _folder()
    parser = OverridesParser.create()
    seen: dict[str, Any] = {}

    def parse(items: list[str]) -> list[Any]:
        new = [item for item in dict.fromkeys(items) if item not in seen]
        if new:
            seen.update(zip(new, parser.parse_overrides(new), strict=True))
        return [seen[item] for item in items]

    bases: dict[tuple[Any, ...], _Base] = {}
    results: list[Config | None] = [None] * len(override_lists)
    users = [user_config_dir(o, config_dir) for o in override_lists]
    for user in dict.fromkeys(users):
        check_yaml_folders(user)
        todo = [i for i, u in enumerate(users) if u == user]
        while todo:
            slow = None
            with _hydra(user), references_kept():
                while todo:
                    index = todo.pop(0)
                    overrides = override_lists[index]
                    try:
                        for override in parse(list(overrides)):
                            check_override(override)
                        parsed = parse(_for_hydra(overrides, user))
                        choices = tuple(str(o.input_line) for o in parsed
                                        if o.key_or_group in GROUPS)
                        if (user, *choices) not in bases:
                            base = hydra_compose("config", overrides=list(choices))
                            reject_unknown_keys(OmegaConf.to_container(base, resolve=False),
                                                 Config, "", choices)  # its YAML files, once
                            bases[(user, *choices)] = _Base(base)
                        node = bases[(user, *choices)].copy()
                        values = [o for o in parsed if o.key_or_group not in GROUPS]
                        ConfigLoaderImpl._apply_overrides_to_config(values, node)
                        with references_kept(marks_in(node)):
                            results[index] = _finish(node, overrides, whole=False)
                    except (HydraException, OmegaConfBaseException, UserError):
                        slow = index
                        break
            if slow is not None:  # compose() takes it or says what is wrong, in one line
                results[slow] = _one(slow, override_lists[slow], config_dir)
    return [cfg for cfg in results if cfg is not None]


def _one(index: int, overrides: Sequence[str], config_dir: Path | str | None) -> Config:
    try:
        return compose(overrides, config_dir)
    except UserError as exc:
        raise PointError(index, exc) from None


class _Base:
    """A composed node to start sweep points from: copied by unpickling a snapshot (0.6 ms)
    rather than deep-copied (2.3 ms), where it pickles."""

    def __init__(self, node: Any) -> None:
        self.node = node
        try:
            self.blob: bytes | None = pickle.dumps(node)
        except Exception:  # something of a user's config that does not pickle
            self.blob = None

    def copy(self) -> Any:
        return pickle.loads(self.blob) if self.blob is not None else copy.deepcopy(self.node)


def to_yaml(cfg: Config) -> str:
    """The resolved config as YAML (what run_dir/config.yaml holds), parts in their YAML
    shape (``_target_`` and arguments for a target).

    Plain dataclass -> dict -> YAML, one top-level section at a time, each section's text
    kept for the next config with the same section: a 1000-point sweep writes 1000 configs
    that differ in a key or two (OmegaConf.structured() would cost tens of milliseconds a
    config, a whole dump ~3 ms).
    """
    return "".join(_section_yaml(f.name, getattr(cfg, f.name)) for f in fields(cfg))


_SECTIONS: dict[tuple[str, str], str] = {}


def _section_yaml(name: str, value: Any) -> str:
    # deferred: yaml
    import yaml

    key = (name, repr(value))
    text = _SECTIONS.get(key)
    if text is None:
        plain = (parts.to_plain(name, value) if name in PARTS else
                 dataclasses.asdict(value) if dataclasses.is_dataclass(value)
                 and not isinstance(value, type) else value)
        dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)  # libyaml's emitter if there
        text = str(yaml.dump({name: plain}, Dumper=dumper, sort_keys=False))
        if len(_SECTIONS) > 4096:
            _SECTIONS.clear()
        _SECTIONS[key] = text
    return text


def from_yaml(text: str) -> Config:
    """Read a config written by :func:`to_yaml` back, checked against the schema."""
    # deferred: omegaconf
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    data = yaml_guard.load(text, "config.yaml") or {}
    if not isinstance(data, dict):
        raise UserError("config.yaml", type(data).__name__, "is not a mapping of config keys.",
                        "use a config.yaml hpc_ddp wrote (--cfg prints one).")
    rest = {k: v for k, v in data.items() if k not in PARTS and k not in FREE_FORM}
    try:
        given = data.get("secrets")
        marks: dict[str, Any] = given if isinstance(given, dict) else {}
        with references_kept(Marks.of(map(str, marks.get("secret") or ()),
                                      map(str, marks.get("public") or ()))):
            # a secret stays a reference on the node too (secrets.py), parts' arguments too
            loose = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(compose_schema()),
                                                        rest))
            return _assemble(loose, data)
    except OmegaConfBaseException as exc:
        raise user_error(exc, ()) from None


__all__ = ["CONFIG_DIR_ENV", "GROUPS", "check_conf_dir", "check_overrides", "compose",
           "compose_many", "conf_dir", "from_yaml", "search_folders", "to_yaml",
           "user_config_dir"]
