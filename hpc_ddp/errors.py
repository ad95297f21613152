"""The one exception type for bad input: it names the key, the value and the fix."""

from __future__ import annotations

from typing import Any

from hpc_ddp import redact

#: Exit code of every command on bad input (argparse's convention).
USAGE_EXIT_CODE = 2


def shown(value: Any) -> Any:
    """A value as the user types it (null, true, false), for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return value


class UserError(Exception):
    """Bad input. ``str()`` is one line a user can act on; no traceback is shown for it."""

    def __init__(self, key: str, value: Any, problem: str, fix: str) -> None:
        self.key = key
        self.value = value
        self.problem = problem
        self.fix = fix
        super().__init__(self.message)

    @property
    def message(self) -> str:
        """One line; the value of a secret-named key and any secret-shaped text as ****
        (redact.py): an error is printed, and may be pasted anywhere."""
        value = shown(self.value)
        value = value if isinstance(value, str) else repr(value)
        if redact.secret_name(self.key):
            value = redact.MASK
        text = f"{self.key}={value}: {self.problem}"
        if self.fix:
            text += f" Fix: {self.fix}"
        return redact.mask_shapes(" ".join(text.split()))  # one line, whatever the parts held


class PointError(UserError):
    """The UserError of one of several runs planned together (a sweep's points, by index
    in the order given); its message is the run's own."""

    def __init__(self, index: int, error: UserError) -> None:
        self.index = index
        super().__init__(error.key, error.value, error.problem, error.fix)
