"""What counts as a secret — by its name, or by the shape of its value — and how it is hidden.

The rules (docs/security.md "Secrets"):

- a name holds a secret when one of its words (``WANDB_API_KEY``, ``model.api_token``,
  ``--hf-token``, ``dbPassword``: split at ``_ - .`` and case changes) is TOKEN, JWT, PAT,
  SECRET, PASSWORD, PASSWD, PASSPHRASE, CREDENTIAL(S), PRIVATE, WEBHOOK, DSN, AUTH or BEARER
  at the end, PASS or PWD after another word (``SSHPASS``, ``MYSQL_PWD``; not ``PWD``), KEY,
  API_KEY or KEY_ID at the end (``WANDB_API_KEY``, ``AWS_ACCESS_KEY_ID``; not
  ``NCCL_IB_PKEY``, not ``key_dim``), API_KEYS, AUTHORIZATION, COOKIE(S) or
  SESSION_ID/KEY/TOKEN at the end, or when it is ``CONNECTION_STRING`` / ``DATABASE_URL``; a
  script's or a setup line's short flag ``-p`` (a password for mysql, sshpass);
- a value is a secret by its shape: a URL with a password (``https://user:pw@host``, and
  ``user:pw@host[:port]`` without a scheme, e.g. a proxy's),
  ``AccountKey=...``, a private key block, a JWT, and the token prefixes of Hugging Face
  (``hf_``), GitHub (``ghp_``, ``github_pat_``...), GitLab (``glpat-``), OpenAI and others
  (``sk-``), Slack (``xox?-``) and AWS (``AKIA``/``ASIA``), and the credentials of an
  HTTP ``Authorization: Bearer ...`` / ``Basic ...`` header; the ``user:password`` after
  curl's ``-u``/``--user`` (``-U``/``--proxy-user``) in a setup line or a script's arguments
  (:func:`user_password`);
- ``secrets.secret`` / ``secrets.public`` in the config mark names the rules get wrong
  (:class:`Marks`).

Pure functions, no imports beyond the standard library: errors.py masks with them before
any config exists.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

MASK = "****"

# (A number may follow the last word: HF_TOKEN2, API_KEY_1.)
_WORDS = re.compile(r"""
    (?:^|_)(?:TOKEN|JWT|PAT|PRIVATE|WEBHOOK|DSN|AUTH|AUTHORIZATION|BEARER)(?:_?\d+)?$
  | (?:^|_)(?:PRIVATE|WEBHOOK)_
  | SECRET | PASSWORD | PASSWD | PASSPHRASE | CREDENTIAL
  | (?:^|_)SSHPASS$ | _PASS$ | _PWD$
  | (?:^|_)(?:API_?)?KEY(?:_ID)?(?:_?\d+)?$ | (?:^|_)API_?KEYS$
  | (?:^|_)COOKIES?$ | (?:^|_)SESSION_?(?:ID|KEY|TOKEN)S?$
  | CONNECTION_STRING | (?:^|_)DATABASE_URL$
""", re.VERBOSE)
# Short flags that take a password (``mysql -p X``, ``sshpass -p X``): secret as a script's
# or a setup line's flag only (a config key named p, a dropout's, is not).
SECRET_SHORT_FLAGS = ("-p",)

_SHAPES = re.compile(r"""
    (?<![A-Za-z0-9_])(?:
        hf_[A-Za-z0-9]{16,}
      | gh[pousr]_[A-Za-z0-9]{20,} | github_pat_[A-Za-z0-9_]{20,}
      | glpat-[A-Za-z0-9_-]{16,}
      | sk-[A-Za-z0-9_-]{16,}
      | xox[abprs]-[A-Za-z0-9-]{10,}
      | (?:AKIA|ASIA)[0-9A-Z]{16}(?![0-9A-Z])
      | eyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]*
    )
  | (?<=://)[^\s/:@'"]*:[^\s/'"]+(?=@)
  | (?<![^\s='",])[\w.%+~-]+:[^\s/@'":]+(?=@[A-Za-z0-9][\w.-]*(?::\d+)?(?:[/\s'",]|$))
  | (?:(?<=Bearer\ )|(?<=bearer\ )|(?<=BEARER\ )|(?<=Basic\ )|(?<=basic\ ))[A-Za-z0-9._~+/-]{8,}=*
  | (?<=AccountKey=)[^;\s'"]+
  | -----BEGIN[A-Z ]*PRIVATE\ KEY-----[^-]*-----END[A-Z ]*PRIVATE\ KEY-----
""", re.VERBOSE)

# Flags whose value is ``user:password`` (curl's -u/--user, -U/--proxy-user): credentials
# only with a password, and not as digits (``docker -u 1000:1000`` is a uid:gid).
USER_FLAGS = ("-u", "--user", "-U", "--proxy-user")
_USER_PASSWORD = re.compile(r"[^:\s]*:\S+")

# A value shorter than this is not masked where it appears in a text (a secret-named
# variable set to 0 would mask every 0); it is still never written under its own name.
MASK_MIN = 6


def normalized(name: str) -> str:
    """``model.apiToken`` / ``--hf-token`` -> ``MODEL_API_TOKEN`` / ``HF_TOKEN``."""
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name.strip().lstrip("-+~"))
    return re.sub(r"[^A-Z0-9]+", "_", spaced.upper()).strip("_")


@dataclass(frozen=True)
class Marks:
    """Names marked secret (``secret``) or not (``public``) in the config (secrets.secret,
    secrets.public): an environment variable's name, a dotted key (``model.db_url``, or its
    last part ``db_url`` for every part), a script flag (``--db``)."""

    secret: frozenset[str] = field(default_factory=frozenset)
    public: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def of(cls, secret: Iterable[str] = (), public: Iterable[str] = ()) -> Marks:
        return cls(frozenset(map(normalized, secret)), frozenset(map(normalized, public)))

    def says(self, name: str) -> bool | None:
        """True/False where a mark decides ``name``; None where the rules do."""
        forms = {normalized(name), normalized(name.rpartition(".")[2])}
        if forms & self.public:
            return False
        if forms & self.secret:
            return True
        return None


NO_MARKS = Marks()


def secret_name(name: str, marks: Marks = NO_MARKS) -> bool:
    """Whether the value of ``name`` (a variable, a dotted key, a flag) is a secret."""
    said = marks.says(name)
    if said is not None:
        return said
    if name.strip() in SECRET_SHORT_FLAGS:
        return True
    return bool(_WORDS.search(normalized(name.rpartition(".")[2])))


def user_password(flag: str, value: str) -> bool:
    """Whether ``value``, given to ``flag``, is a ``user:password`` (``curl -u me:pw``)."""
    return (flag in USER_FLAGS and bool(_USER_PASSWORD.fullmatch(value))
            and not re.fullmatch(r"[\d:]+", value))


def secret_value(text: str) -> bool:
    """Whether ``text`` holds a secret by its shape, whatever its name."""
    return bool(_SHAPES.search(text))


def mask_shapes(text: str) -> str:
    """``text`` with every secret-shaped part as ****."""
    return _SHAPES.sub(MASK, text)


def mask(text: str, values: Iterable[str]) -> str:
    """``text`` with ``values`` (longest first) and every secret-shaped part as ****."""
    for value in sorted(values, key=len, reverse=True):
        if len(value) >= MASK_MIN and value in text:
            text = text.replace(value, MASK)
    return mask_shapes(text)


# NAME= and the value after it (quoted, or up to a space, a comma, a closing bracket, a
# quote or ": "), found at every NAME (``comment=token=x``: comment's, then token's).
_ASSIGNED = re.compile(r"""(?<![\w.-])([A-Za-z_][\w.-]*)=(?=('[^']*'|"[^"]*"|"""
                       r"""(?:[^\s,;:'"\])}]|:(?=\S))*))""")


def mask_assigned(text: str, marks: Marks = NO_MARKS) -> str:
    """``text`` with the value of each ``NAME=value`` of a secret NAME as ****, however short
    (an error line echoing ``+cluster.sbatch_extra.comment=token=x``); a reference
    (``${oc.env:NAME}``) is kept."""
    out, last = [], 0
    for match in _ASSIGNED.finditer(text):
        value = match.group(2)
        if match.start() < last or not value or value.startswith("${") or value == MASK or \
                not secret_name(match.group(1), marks):
            continue
        out.append(text[last:match.end()] + MASK)
        last = match.end() + len(value)
    return "".join(out) + text[last:]


def values_to_mask(environ: Mapping[str, str], extra: Iterable[str] = (),
                   marks: Marks = NO_MARKS) -> list[str]:
    """The texts :func:`mask` hides: the values of secret-named or secret-shaped variables
    and ``extra``, longest first (a value inside another is masked with it)."""
    values = {v for k, v in environ.items() if secret_name(k, marks) or secret_value(v)}
    return sorted(values | set(extra), key=len, reverse=True)
