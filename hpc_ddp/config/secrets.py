"""Secrets never reach a file hpc_ddp writes or a line it prints: they travel as references.

A secret may come in through a ``cluster.setup`` line (``export WANDB_API_KEY=...``), an entry
of ``nccl.env``/``nccl.extra_env``, or the environment. The rules (docs/security.md):

1. A variable whose name contains KEY, TOKEN, SECRET, PASSWORD, PASSWD, PASSPHRASE,
   CREDENTIAL or PRIVATE (any case) holds a secret.
2. ``${oc.env:NAME}`` of such a NAME is the way to pass one. It is never resolved on the
   submit side (compose keeps it as written, :func:`references_kept`) but where it is used, on
   the node: by the batch script's shell for a setup line (rendered as ``${NAME}``,
   :func:`shell_lines`), by the rank for nccl.env/extra_env (:func:`resolve`).
3. A literal value given for such a name (``export WANDB_API_KEY=abc`` in a setup line,
   ``nccl.extra_env.HF_TOKEN=abc``) is replaced at submission by ``${oc.env:NAME}`` in the
   config and in the saved overrides (:func:`extract`), and the value itself travels in the
   environment of the submission only: sbatch's exported environment, the local ranks'
   environment (:func:`exported`). config.yaml, overrides.yaml, job.json, the sbatch script
   and submitit's pickles hold the reference, never the value.
4. The values of secret-named variables (and the literals of 3.) are masked as ``****`` in
   what hpc_ddp prints and logs (:func:`mask`, the ranks' log filter).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from hpc_ddp.errors import UserError

SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|PASSPHRASE|CREDENTIAL|PRIVATE",
                         re.IGNORECASE)
MASK = "****"
# ${oc.env:NAME} or ${oc.env:NAME,default}
REFERENCE = re.compile(r"\$\{oc\.env:([A-Za-z_][A-Za-z0-9_]*)(?:,([^}]*))?\}")
# NAME=value in a shell line or an override: the value quoted, or up to a separator.
_ASSIGNMENT = re.compile(r"(?<![A-Za-z0-9_])([A-Za-z_][A-Za-z0-9_]*)=('[^']*'|\"[^\"]*\"|"
                         r"[^\s;&|'\",\]\)]*)")
# A value shorter than this is not masked where it appears in a text (NCCL_IB_PKEY=0 would
# mask every 0); it is still never written under its own name.
_MASK_MIN = 6


def looks_secret(name: str) -> bool:
    return bool(SECRET_NAME.search(name))


def reference(name: str) -> str:
    return "${oc.env:" + name + "}"


def _is_passed_on(value: str) -> bool:
    """Already a reference: ours, or the shell's own $NAME / ${NAME}."""
    return bool(REFERENCE.fullmatch(value)) or value.startswith("$")


def _unquoted(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1]
    return value


@contextlib.contextmanager
def references_kept() -> Iterator[None]:
    """OmegaConf's ``oc.env`` leaves secret names as ``${oc.env:NAME}`` meanwhile (rule 2);
    any other name resolves as ever."""
    # deferred: omegaconf
    from omegaconf import OmegaConf
    from omegaconf._utils import _DEFAULT_MARKER_
    from omegaconf.resolvers import oc

    def env(key: str, default: Any = _DEFAULT_MARKER_) -> Any:
        if not looks_secret(key):
            return oc.env(key, default)
        return "${oc.env:" + key + ("" if default is _DEFAULT_MARKER_ else f",{default}") + "}"

    OmegaConf.register_new_resolver("oc.env", env, replace=True)
    try:
        yield
    finally:
        OmegaConf.register_new_resolver("oc.env", oc.env, replace=True)


def _scrub_line(line: str, found: dict[str, str], where: str, strict: bool = True) -> str:
    """``line`` with the value of every secret-named assignment replaced by a reference."""

    def swap(match: re.Match[str]) -> str:
        name, value = match.group(1), match.group(2)
        if not looks_secret(name) or _is_passed_on(_unquoted(value)) or not value:
            return match.group(0)
        _found(found, name, _unquoted(value), where, strict)
        return f"{name}={reference(name)}"

    return _ASSIGNMENT.sub(swap, line)


def _found(found: dict[str, str], name: str, value: str, where: str,
           strict: bool = True) -> None:
    """Note ``name``'s literal; ``strict``: refuse a second, different one (one variable of
    the job's environment carries it; overrides are not strict: the last one wins)."""
    if strict and found.get(name, value) != value:
        raise UserError(where, MASK, f"gives {name} a second, different value.",
                        f"give {name} one value (or pass it as ${{oc.env:{name}}}).")
    found[name] = value


def extract(cfg: Any) -> tuple[Any, dict[str, str]]:
    """``cfg`` with every literal secret replaced by its reference (rule 3), and name ->
    value of those literals (to be exported to the job's environment)."""
    found: dict[str, str] = {}
    c = cfg.cluster
    setup = [_scrub_line(line, found, "cluster.setup") for line in c.setup]
    sections = {}
    for section in ("env", "extra_env"):
        values = dict(getattr(cfg.nccl, section))
        for name, value in values.items():
            text = str(value)
            if looks_secret(name) and text and not _is_passed_on(text):
                _found(found, name, text, f"nccl.{section}.{name}")
                values[name] = reference(name)
        sections[section] = values
    for key, value in c.sbatch_extra.items():
        if REFERENCE.search(str(value)):
            raise UserError(f"cluster.sbatch_extra.{key}", value,
                            "passes an environment variable to an sbatch option: #SBATCH lines "
                            "cannot read the environment, and every user of the cluster can "
                            "read a job's options (scontrol show job).",
                            "pass a secret through cluster.setup instead: "
                            "export NAME=${oc.env:NAME} (docs/security.md).")
    if not found:
        return cfg, {}
    cluster = dataclasses.replace(c, setup=setup)
    nccl = dataclasses.replace(cfg.nccl, **sections)
    return dataclasses.replace(cfg, cluster=cluster, nccl=nccl), found


# NAME: value inside a dict override (nccl.extra_env={HF_TOKEN: abc}).
_ENTRY = re.compile(r"(?<![A-Za-z0-9_])([A-Za-z_][A-Za-z0-9_]*)\s*:\s*"
                    r"('[^']*'|\"[^\"]*\"|[^,}\s]*)")
_ENV_SECTIONS = ("nccl.env", "nccl.extra_env")


def _scrub_override(override: str, found: dict[str, str]) -> str:
    """One override with its secret literals as references: only where rule 3 applies (a
    setup line, an nccl.env/extra_env entry); model.kwargs.key_dim=64 is no secret."""
    key, eq, value = override.partition("=")
    bare = key.lstrip("+~")
    if not eq:
        return override
    if bare == "cluster.setup" or bare.startswith("cluster.setup["):
        return f"{key}={_scrub_line(value, found, bare, strict=False)}"
    section, _, name = bare.rpartition(".")
    if section in _ENV_SECTIONS and looks_secret(name):
        text = _unquoted(value)
        if text and not _is_passed_on(text):
            _found(found, name, text, bare, strict=False)
            return f"{key}={reference(name)}"
        return override
    if bare in _ENV_SECTIONS:
        def swap(match: re.Match[str]) -> str:
            entry, text = match.group(1), _unquoted(match.group(2))
            if not looks_secret(entry) or not text or _is_passed_on(text):
                return match.group(0)
            _found(found, entry, text, f"{bare}.{entry}", strict=False)
            return f"{entry}: '{reference(entry)}'"

        return f"{key}={_ENTRY.sub(swap, value)}"
    return override


def scrub_overrides(overrides: Sequence[str]) -> list[str]:
    """The overrides as overrides.yaml keeps them: secret literals as references."""
    found: dict[str, str] = {}
    return [_scrub_override(o, found) for o in overrides]


def literals_in(overrides: Sequence[str]) -> list[str]:
    """The secret literals a command line gives (to mask them in what it prints)."""
    found: dict[str, str] = {}
    for o in overrides:
        _scrub_override(o, found)
    return list(found.values())


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


def referenced(cfg: Any) -> list[str]:
    """Names the config passes by reference (to say which must be in the environment)."""
    texts = [*cfg.cluster.setup, *map(str, cfg.nccl.env.values()),
             *map(str, cfg.nccl.extra_env.values())]
    return sorted({m.group(1) for text in texts for m in REFERENCE.finditer(text)})


def values_to_mask(environ: Mapping[str, str], extra: Iterable[str] = ()) -> list[str]:
    """The texts :func:`mask` hides: the values of secret-named variables and ``extra``,
    longest first (a value inside another is masked with it)."""
    values = {v for k, v in environ.items() if looks_secret(k)} | set(extra)
    return sorted((v for v in values if len(v) >= _MASK_MIN), key=len, reverse=True)


def mask(text: str, values: Iterable[str]) -> str:
    for value in values:
        if value and value in text:
            text = text.replace(value, MASK)
    return text


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
