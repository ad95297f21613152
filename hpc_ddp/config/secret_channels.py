"""The channels a secret comes in by, each with its own way to hold a reference instead of
the literal (config/secrets.py has the table; hpc_ddp/redact.py says what a secret is)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from hpc_ddp.errors import UserError
from hpc_ddp.redact import (
    MASK,
    USER_FLAGS,
    Marks,
    normalized,
    secret_name,
    secret_value,
    user_password,
)

# ${oc.env:NAME} or ${oc.env:NAME,default}
REFERENCE = re.compile(r"\$\{oc\.env:([A-Za-z_][A-Za-z0-9_]*)(?:,([^}]*))?\}")
PREFIX = "HPC_DDP_SECRET_"
ENV_SECTIONS = ("nccl.env", "nccl.extra_env", "cluster.container.env")
TREES = ("model", "data", "loss", "optim", "scheduler", "metrics", "app")
# A shell word: quoted parts, ANSI-C $'...', escapes, or plain characters.
_WORD = re.compile(r"""(?:'[^']*'|\$'(?:\\.|[^'\\])*'|"(?:\\.|[^"\\])*"|\\.|[^\s;&|<>()`'"\\])+""")
_ASSIGN = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.DOTALL)


def reference(name: str) -> str:
    return "${oc.env:" + name + "}"


def is_reference(text: str) -> bool:
    return bool(REFERENCE.fullmatch(text))


class Names:
    """The variables of several runs that share one environment (a sweep's job array): a
    name whose value differs from an earlier run's is carried by a variable of its own,
    ``HPC_DDP_SECRET_P<point>_NAME``, in that run's config and overrides alike."""

    def __init__(self) -> None:
        self.point = 0  # the run being planned (api.plan_many sets it)
        self._taken: dict[str, str] = {}
        self._renamed: dict[tuple[str, str], str] = {}

    def variable(self, name: str, value: str) -> str:
        if self._taken.setdefault(name, value) == value:
            return name
        key = (name, value)
        if key not in self._renamed:
            self._renamed[key] = f"{PREFIX}P{self.point}_{name.removeprefix(PREFIX)}"
            self._taken[self._renamed[key]] = value
        return self._renamed[key]


class Found:
    """name -> literal of what a config or a command line gives; ``strict``: a second,
    different value for one name is refused (one variable of the job carries it).
    ``names``: the variables shared with other runs (:class:`Names`); ``values`` then maps
    the variables that carry the literals."""

    def __init__(self, marks: Marks, strict: bool = True, names: Names | None = None) -> None:
        self.values: dict[str, str] = {}
        self.marks, self.strict, self.names = marks, strict, names
        self._given: dict[str, str] = {}

    def take(self, name: str, value: str, where: str) -> str:
        if self.strict and self._given.get(name, value) != value:
            raise UserError(where, MASK, f"gives {name} a second, different value.",
                            f"give {name} one value (or pass it as ${{oc.env:{name}}}).")
        self._given[name] = value
        variable = self.names.variable(name, value) if self.names else name
        self.values[variable] = value
        return reference(variable)

    def variable(self, name: str) -> str:
        """The variable that carries the value of ``name``: its own for a secret name
        (WANDB_API_KEY), else one whose name marks it as a secret (a value secret by its
        shape: PIP_INDEX_URL -> HPC_DDP_SECRET_PIP_INDEX_URL), so that no reference to it is
        resolved where the config is composed or read back."""
        return name if secret_name(name, self.marks) else PREFIX + name


# -- the channels ---------------------------------------------------------------------------


def _shell_literal(word: str) -> str | None:
    """The text a shell word stands for, or None when the shell would expand something in
    it ($NAME, ${NAME}, $(...), `...`: a reference, passed on as it is)."""
    out, i = [], 0
    while i < len(word):
        c = word[i]
        if c == "'":
            end = word.index("'", i + 1)
            out.append(word[i + 1:end])
            i = end + 1
        elif word.startswith("$'", i):
            end = i + 2
            while word[end] != "'":
                end += 2 if word[end] == "\\" else 1
            out.append(word[i + 2:end].encode().decode("unicode_escape"))
            i = end + 1
        elif c == '"':
            end = i + 1
            while word[end] != '"':
                end += 2 if word[end] == "\\" else 1
            inner = word[i + 1:end]
            if re.search(r"(?<!\\)[$`]", inner):
                return None
            out.append(re.sub(r"\\([$`\"\\])", r"\1", inner))
            i = end + 1
        elif c in "$`":
            return None
        elif c == "\\":
            out.append(word[i + 1:i + 2])
            i += 2
        else:
            out.append(c)
            i += 1
    return "".join(out)


_LOOSE = re.compile(r"""([A-Za-z_][\w.-]*)\s*[=:]\s*('[^']*'?|"[^"]*"?|[^\s,\]}]+)""")


def loose_literals(text: str, found: Found) -> None:
    """``NAME=value`` / ``NAME: value`` pairs of a secret NAME in text that parses as
    nothing (an override Hydra refuses), taken to be masked in what is printed."""
    for match in _LOOSE.finditer(text):
        value = match.group(2).strip("'\"")
        if value and secret_name(match.group(1), found.marks):
            found.values[f"{PREFIX}LOOSE_{len(found.values)}"] = value


def scrub_setup(lines: Sequence[str], found: Found, where: str) -> list[str]:
    """Setup lines with every literal secret as a reference: ``NAME=value`` of a secret NAME
    or value, a secret-named flag's value (``--token x``, ``--token=x``), curl's
    ``-u user:password`` (``--user=``, ``-uuser:password``), any secret-shaped word."""
    anonymous = 0
    done = []
    for line in lines:
        flag = ""  # the flag the word before was, whose value this word may be

        def taken(literal: str) -> str:
            nonlocal anonymous
            anonymous += 1
            return '"' + found.take(f"{PREFIX}SETUP_{anonymous}", literal, where) + '"'

        def swap(match: re.Match[str]) -> str:
            nonlocal flag
            word = match.group(0)
            after, flag = flag, ""
            assign = _ASSIGN.match(word)
            if assign and not word.startswith("-"):
                name, value = assign.group(1), _shell_literal(assign.group(2))
                if value and (secret_name(name, found.marks) or secret_value(value)):
                    return f"{name}={found.take(found.variable(name), value, where)}"
                return word
            literal = _shell_literal(word)
            if literal is None:
                return word
            if literal.startswith("-"):
                name, eq, value = literal.partition("=")
                if eq and value and (secret_name(name, found.marks) or secret_value(value)
                                     or user_password(name, value)):
                    return f"{name}={taken(value)}"  # --token=x: the flag stays a word
                if not eq and literal[:2] in USER_FLAGS and user_password(literal[:2],
                                                                          literal[2:]):
                    return literal[:2] + taken(literal[2:])  # -uuser:password
                flag = "" if eq else literal
            if literal and (after and (secret_name(after, found.marks)
                                       or user_password(after, literal))
                            or secret_value(literal)):
                return taken(literal)
            return word

        try:
            done.append(_WORD.sub(swap, line))
        except (ValueError, IndexError):  # unbalanced quotes: the shell will say so
            done.append(line)
    return done


def scrub_env(section: str, values: Mapping[str, Any], found: Found) -> dict[str, Any]:
    """An environment section (nccl.env, nccl.extra_env, cluster.container.env): a literal
    of a secret name or a secret-shaped one as ``${oc.env:NAME}``. A value starting with
    ``$`` is a literal here: nothing expands it."""
    out = dict(values)
    for name, value in values.items():
        text = "" if value is None else str(value)
        if text and not is_reference(text) and (
                secret_name(name, found.marks) or secret_value(text)):
            out[name] = found.take(found.variable(name), text, f"{section}.{name}")
    return out


def scrub_tree(path: str, value: Any, found: Found) -> Any:
    """A part's arguments or ``app``: a leaf under a secret-named key, or a secret-shaped
    string, as ``${oc.env:HPC_DDP_SECRET_<KEY>}``."""
    if isinstance(value, Mapping):
        return {k: scrub_tree(f"{path}.{k}", v, found) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [scrub_tree(f"{path}.{i}", v, found) for i, v in enumerate(value)]
    if value is None or isinstance(value, bool):
        return value
    text = str(value)
    if text and not is_reference(text) and (
            secret_name(path, found.marks) or (isinstance(value, str) and secret_value(text))):
        return found.take(PREFIX + normalized(path), text, path)
    return value


def scrub_script_args(args: Sequence[str], found: Found) -> list[str]:
    """A script's arguments: ``--flag=value`` / ``NAME=value`` and ``--flag value`` of a
    secret-named flag (and ``--user user:password``), and any secret-shaped argument, as
    references (resolved in the
    script's process, never on its command line: rank/main/script_runner.py)."""
    out = list(args)
    for i, arg in enumerate(args):
        if is_reference(arg) or out[i] != arg:  # a flag's value, taken already
            continue
        name, eq, value = arg.partition("=")
        if eq and (name.startswith("-") or name.isidentifier()) and value and \
                not is_reference(value):
            if secret_name(name, found.marks) or secret_value(value) or \
                    user_password(name, value):
                where = PREFIX + "ARG_" + normalized(name)
                out[i] = f"{name}={found.take(where, value, 'script_args')}"
            continue
        nxt = args[i + 1] if i + 1 < len(args) else ""
        if arg.startswith("-") and not eq and nxt and not nxt.startswith("-") and (
                secret_name(arg, found.marks) or user_password(arg, nxt)) and \
                not is_reference(nxt):
            out[i + 1] = found.take(PREFIX + "ARG_" + normalized(arg), nxt, "script_args")
        elif secret_value(arg):
            out[i] = found.take(f"{PREFIX}ARG_{i}", arg, "script_args")
    return out


# -- what others can read (sbatch options, srun's and a container's arguments: refused) ----


def named_secrets(args: Sequence[str], marks: Marks) -> list[tuple[str, str]]:
    """(name, value) of each secret a list of arguments sets by name: ``NAME=value``
    anywhere in an item (``--export=ALL,HF_TOKEN=x``, ``--env WANDB_API_KEY=x``,
    ``--comment password=x``), ``--flag=value`` and ``--flag value`` with a secret's name
    (``--token x``). ``--export=ALL,HF_TOKEN`` passes a variable by name, no value: allowed."""
    words = [w for a in args for w in str(a).split()]
    found = []
    for i, word in enumerate(words):
        for piece in re.split(r"[,\s]+", word):
            parts = piece.split("=")
            found += [(name, "=".join(parts[k + 1:])) for k, name in enumerate(parts[:-1])
                      if parts[k + 1] and secret_name(name, marks)]
        nxt = words[i + 1] if i + 1 < len(words) else ""
        if word.startswith("-") and "=" not in word and nxt and not nxt.startswith("-") and (
                secret_name(word, marks)):
            found.append((word, nxt))
    return found


def open_literals(given: Any, found: Found) -> None:
    """The secrets an override of what others can read gives (``+cluster.sbatch_extra.
    comment='password=x'``): extract() refuses them; taken here to be masked meanwhile (in
    the refusal's line and any other the command prints)."""
    items = given if isinstance(given, list) else [given]
    pairs = [p for v in items if isinstance(v, Mapping) for p in v.items()]
    texts = [str(v) for v in items if not isinstance(v, Mapping)] + [str(v) for _, v in pairs]
    for text in [v for _, v in named_secrets(texts, found.marks)] + [
            str(v) for k, v in pairs if secret_name(str(k), found.marks)]:
        found.values[f"{PREFIX}OPEN_{len(found.values)}"] = text
