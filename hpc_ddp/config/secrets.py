"""Secrets never reach a file hpc_ddp writes, a line it prints or a command line.

What a secret is, by name and by the shape of its value, is hpc_ddp/redact.py's (with the
marks of ``secrets.secret`` / ``secrets.public``). Where one may come in, and what becomes of
it (docs/security.md):

=========================================  ==================================================
channel                                    the literal is replaced, in the config and in the
                                           saved overrides, by
=========================================  ==================================================
``cluster.setup`` (shell lines)            ``NAME=${oc.env:NAME}``; any other word, e.g. after
                                           ``--token``, by ``"${oc.env:HPC_DDP_SECRET_...}"``
``nccl.env``, ``nccl.extra_env``,          ``${oc.env:NAME}`` (the variable's own name; for a
``cluster.container.env``                  value secret by its shape only, HPC_DDP_SECRET_NAME)
a ``_target_`` part's arguments, ``app``   ``${oc.env:HPC_DDP_SECRET_MODEL_API_TOKEN}`` (the key)
a script's arguments (after ``--``)        ``--hf-token ${oc.env:HPC_DDP_SECRET_ARG_HF_TOKEN}``
=========================================  ==================================================

The values travel in the environment of the submission only (sbatch exports it to the job,
the local ranks inherit it: :func:`exported`) and are read where they are used: by the batch
script's shell (:func:`shell_lines`), by the rank for NCCL and container variables
(:func:`resolve`), by Hydra's instantiate for a part, by ``ctx.app``, by the script runner for
a script's argv (in the process, never on a command line). ``${oc.env:NAME}`` of a secret is
never resolved at submission (:func:`references_kept`). Sbatch options, srun arguments, a
container's options and image cannot carry one (:func:`extract` refuses: ``scontrol show job``
and ``ps`` show them to every user). Printed and logged text masks the values as ``****``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from hpc_ddp.config.secret_channels import (
    ENV_SECTIONS,
    PREFIX,
    REFERENCE,
    TREES,
    Found,
    Names,
    loose_literals,
    named_secrets,
    open_literals,
    reference,
    scrub_env,
    scrub_script_args,
    scrub_setup,
    scrub_tree,
)
from hpc_ddp.errors import UserError
from hpc_ddp.redact import MASK, NO_MARKS, Marks, secret_name, secret_value
from hpc_ddp.redact import mask as mask
from hpc_ddp.redact import mask_assigned as mask_assigned
from hpc_ddp.redact import values_to_mask as values_to_mask


def looks_secret(name: str, marks: Marks = NO_MARKS) -> bool:
    return secret_name(name, marks)


def marks_of(cfg: Any) -> Marks:
    return Marks.of(cfg.secrets.secret, cfg.secrets.public)


@contextlib.contextmanager
def references_kept(marks: Marks = NO_MARKS) -> Iterator[None]:
    """OmegaConf's ``oc.env`` leaves secret names as ``${oc.env:NAME}`` meanwhile; any
    other name resolves as ever."""
    # deferred: omegaconf
    from omegaconf import OmegaConf
    from omegaconf._utils import _DEFAULT_MARKER_
    from omegaconf.resolvers import oc

    def env(key: str, default: Any = _DEFAULT_MARKER_) -> Any:
        if not secret_name(key, marks):
            return oc.env(key, default)
        return "${oc.env:" + key + ("" if default is _DEFAULT_MARKER_ else f",{default}") + "}"

    OmegaConf.register_new_resolver("oc.env", env, replace=True)
    try:
        yield
    finally:
        OmegaConf.register_new_resolver("oc.env", oc.env, replace=True)


# What a task's command line holds, which every user of a node can read (ps), and the
# job's options, which every user of the cluster can (scontrol show job).
_IN_THE_OPEN = ("srun_args", "sbatch_extra", "container.options", "container.image",
                "container.gpu_flags", "container.mounts", "python", "venv", "conda_env",
                "job_name", "partition", "account", "qos", "constraint")
_OPEN_KEYS = tuple(f"cluster.{name}" for name in _IN_THE_OPEN)


def _refuse_in_the_open(cfg: Any) -> None:
    c = cfg.cluster
    marks = marks_of(cfg)
    for key, value in c.sbatch_extra.items():
        if REFERENCE.search(str(value)):
            raise UserError(f"cluster.sbatch_extra.{key}", value,
                            "passes an environment variable to an sbatch option: #SBATCH lines "
                            "cannot read the environment, and every user of the cluster can "
                            "read a job's options (scontrol show job).",
                            "pass a secret through cluster.setup instead: "
                            "export NAME=${oc.env:NAME} (docs/security.md).")
    for name in _IN_THE_OPEN:
        holder, _, field = name.rpartition(".")
        value = getattr(getattr(c, holder) if holder else c, field)
        # A mapping's values are options of their own (sbatch_extra: --comment=..., each
        # checked alone); a list is one command line (a flag, then its value).
        items = ([(f"cluster.{name}.{k}", k, v) for k, v in value.items()]
                 if isinstance(value, Mapping) else [(f"cluster.{name}", "", value)])
        for where, key, item in items:
            texts = ["" if v is None else str(v)
                     for v in (item if isinstance(item, list) else [item])]
            named = [n for n, _ in named_secrets(texts, marks)]
            if key and secret_name(str(key), marks):
                named.insert(0, str(key))
            if named or any(secret_value(t) or REFERENCE.search(t) for t in texts):
                what = f"a secret ({named[0].lstrip('-')})" if named else "a secret"
                raise UserError(where, MASK, f"would put {what} on a command line or among "
                                "the job's options, which other users of the cluster can read "
                                "(ps, scontrol show job).", "pass it in the environment: "
                                "cluster.setup=['export NAME=${oc.env:NAME}'] or "
                                "cluster.container.env (docs/security.md).")


def extract(cfg: Any, names: Names | None = None) -> tuple[Any, dict[str, str]]:
    """``cfg`` with every literal secret replaced by its reference, and name -> value of
    those literals (to be exported to the job's environment); ``names``: shared with the
    other points of a sweep (:class:`Names`)."""
    _refuse_in_the_open(cfg)
    found = Found(marks_of(cfg), names=names)
    c = cfg.cluster
    setup = scrub_setup(c.setup, found, "cluster.setup")
    nccl = {s: scrub_env(f"nccl.{s}", getattr(cfg.nccl, s), found) for s in ("env", "extra_env")}
    container = scrub_env("cluster.container.env", c.container.env, found)
    parts = {}
    for part in TREES[:-1]:
        value = getattr(cfg, part)
        if value.target is not None:
            parts[part] = dataclasses.replace(value, kwargs=scrub_tree(part, value.kwargs, found))
    app = scrub_tree("app", cfg.app, found)
    script_args = scrub_script_args(cfg.script_args, found)
    if not found.values:
        return cfg, {}
    cluster = dataclasses.replace(c, setup=setup, container=dataclasses.replace(
        c.container, env=container))
    return dataclasses.replace(cfg, cluster=cluster, nccl=dataclasses.replace(cfg.nccl, **nccl),
                               app=app, script_args=script_args, **parts), found.values


# -- overrides (overrides.yaml, a sweep's manifest, masking a command line) ------------------


@functools.cache
def _parser() -> Any:
    # deferred: hydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create()


def _render(value: Any) -> str:
    """``value`` in Hydra's override grammar."""
    # deferred: the typed schemas
    from hpc_ddp.config.overrides import quoted

    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {_render(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_render(v) for v in value) + "]"
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return str(value) if isinstance(value, int | float) else quoted(str(value))


def _may_hold(key: str, value: str, marks: Marks) -> bool:
    """Whether an override could carry a secret (the grammar, ~0.5 ms an override, is asked
    only then: a sweep's thousand points share most of theirs)."""
    bare = key.lstrip("+~")
    return (bare == "cluster.setup" or bare.startswith(("cluster.setup[", *ENV_SECTIONS))
            or bare.startswith(_OPEN_KEYS)
            or secret_name(bare, marks) or secret_value(value)
            or (any(ch in value for ch in "[{=") and any(
                secret_name(w, marks) for w in re.findall(r"[A-Za-z_][\w-]*", value))))


def scrub_override(override: str, found: Found) -> str:
    """One override with its secret literals as the references :func:`extract` makes; each
    value of a sweep over a secret (``model.api_token=a,b``) as a reference of its own."""
    key, eq, value = override.partition("=")
    if not eq or not _may_hold(key, value, found.marks):
        return override
    # deferred: hydra
    from hydra.errors import HydraException

    bare = key.lstrip("+~")
    try:
        (parsed,) = _parser().parse_overrides([override])
        if parsed.is_sweep_override():
            return _scrub_sweep(override, parsed, found)
        given = parsed.value()
    except HydraException:  # not Hydra's grammar: compose() refuses it, its secrets masked
        scrub_setup([value], found, bare)  # NAME=value and flag values, read as shell words
        loose_literals(value, found)
        return f"{key}={MASK}" if secret_name(bare, found.marks) or secret_value(value) \
            else override
    new = _scrubbed(bare, given, found)
    return override if new == given else f"{key}={_render(new)}"


def _scrubbed(bare: str, given: Any, found: Found) -> Any:
    """The value ``given`` of the key ``bare`` with its secret literals as references."""
    section, _, name = bare.rpartition(".")
    if bare == "cluster.setup" or bare.startswith("cluster.setup["):
        new: Any = scrub_setup(given if isinstance(given, list) else [given], found, bare)
        return new if isinstance(given, list) else new[0]
    if bare in ENV_SECTIONS and isinstance(given, Mapping):
        return scrub_env(bare, given, found)
    if section in ENV_SECTIONS:
        return scrub_env(section, {name: given}, found)[name]
    if bare.partition(".")[0] in TREES:
        return scrub_tree(bare, given, found)
    if bare.startswith(_OPEN_KEYS):  # refused by extract(): taken only to mask it meanwhile
        open_literals(given if isinstance(given, list | Mapping) else {name: given}, found)
    return given


def _scrub_sweep(override: str, parsed: Any, found: Found) -> str:
    """A sweep with each value's secrets as references of their own (``app.api_token=a,b``
    -> ``'${oc.env:HPC_DDP_SECRET_APP_API_TOKEN_0}','${oc.env:..._1}'``): each point then
    carries its own reference, and one job array's shared environment all the values."""
    # deferred: hydra
    from hydra.core.override_parser.types import (
        ChoiceSweep,
        Glob,
        QuotedString,
        Sweep,
        Transformer,
    )

    key, _, value = override.partition("=")
    bare = key.lstrip("+~")

    def plain(item: Any) -> Any:
        if isinstance(item, Sweep | Glob):
            raise TypeError("a sweep among a sweep's values")  # expand() refuses it
        if isinstance(item, QuotedString):
            return item.text
        if isinstance(item, list):
            return [plain(v) for v in item]
        if isinstance(item, dict):
            return {plain(k): plain(v) for k, v in item.items()}
        return item

    swept = parsed.value()
    try:
        items = [plain(v) for v in swept.list] if isinstance(swept, ChoiceSweep) else None
    except TypeError:
        items = None
    if items is None:  # range(), interval(), glob(): numbers and option names
        return f"{key}={MASK}" if secret_name(bare, found.marks) or secret_value(value) \
            else override
    texts, changed = [], False
    for index, (item, given) in enumerate(zip(swept.list, items, strict=True)):
        own = Found(found.marks, strict=False)
        new = _scrubbed(bare, given, own)
        text = Transformer.str(item) if new == given else _render(new)
        for name, literal in own.values.items():
            if reference(name) in text:
                changed = True
                stem = name if name.startswith(PREFIX) else PREFIX + name
                text = text.replace(reference(name),
                                    found.take(f"{stem}_{index}", literal, bare))
            else:  # taken to be masked only
                found.values[f"{PREFIX}OPEN_{len(found.values)}"] = literal
        texts.append(text)
    if not changed:
        return override
    listed = ",".join(texts)
    return f"{key}=" + (f"shuffle({listed})" if swept.shuffle else
                        listed if len(texts) > 1 else f"choice({listed})")


def scrub_overrides(overrides: Sequence[str], marks: Marks = NO_MARKS,
                    names: Names | None = None) -> list[str]:
    """The overrides as overrides.yaml and a sweep's manifest keep them: secret literals as
    the references of :func:`extract` (given the same ``names``)."""
    found = Found(marks, strict=False, names=names)
    return [scrub_override(o, found) for o in overrides]


def literals_in(args: Sequence[str], marks: Marks = NO_MARKS) -> list[str]:
    """The secret literals a command line gives (overrides, and a script's arguments after
    ``--``), to mask them in what it prints."""
    found = Found(marks, strict=False)
    split = list(args).index("--") if "--" in args else len(args)
    for o in args[:split]:
        with contextlib.suppress(UserError):
            scrub_override(o, found)
    scrub_script_args(args[split + 1:], found)
    return list(found.values.values())


# -- on the node ----------------------------------------------------------------------------


def shell_lines(lines: Iterable[str]) -> list[str]:
    """Setup lines for the batch script: ``${oc.env:NAME}`` -> ``${NAME}`` (a default as
    ``${NAME:-default}``), read by the shell on the first node."""
    def swap(match: re.Match[str]) -> str:
        name, default = match.group(1), match.group(2)
        return f"${{{name}}}" if default is None else f"${{{name}:-{default}}}"

    return [REFERENCE.sub(swap, line) for line in lines]


def resolve(value: str, environ: Mapping[str, str]) -> str | None:
    """A value with its references replaced from ``environ`` (on the node); None when a
    referenced variable is not set there and has no default."""
    missing = False

    def swap(match: re.Match[str]) -> str:
        nonlocal missing
        name, default = match.group(1), match.group(2)
        if name in environ:
            return environ[name]
        if default is None:
            missing = True
            return ""
        return default

    text = REFERENCE.sub(swap, value)
    return None if missing else text


def resolve_tree(value: Any, environ: Mapping[str, str]) -> Any:
    """``value`` (``app``'s keys) with every reference read from ``environ`` (one that is
    not set there stays as written)."""
    if isinstance(value, Mapping):
        return {k: resolve_tree(v, environ) for k, v in value.items()}
    if isinstance(value, list):
        return [resolve_tree(v, environ) for v in value]
    if isinstance(value, str) and REFERENCE.search(value):
        found = resolve(value, environ)
        return value if found is None else found
    return value


def referenced(cfg: Any) -> list[str]:
    """Names the config passes by reference (to say which must be in the environment)."""
    return sorted({m.group(1) for text in _texts(dataclasses.asdict(cfg))
                   for m in REFERENCE.finditer(text)})


def _texts(value: Any) -> Iterator[str]:
    if isinstance(value, Mapping):
        for item in value.values():
            yield from _texts(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _texts(item)
    elif isinstance(value, str):
        yield value


@contextlib.contextmanager
def exported(values: Mapping[str, str]) -> Iterator[None]:
    """``values`` in os.environ meanwhile: sbatch exports them to the job (its default
    --export=ALL), the local executor hands them to the ranks; nothing writes them to a file."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old
