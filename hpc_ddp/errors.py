"""The one exception type for bad input: it names the key, the value and the fix."""

from __future__ import annotations

from typing import Any

#: Exit code of every command on bad input (argparse's convention).
USAGE_EXIT_CODE = 2


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
        shown = self.value if isinstance(self.value, str) else repr(self.value)
        text = f"{self.key}={shown}: {self.problem}"
        if self.fix:
            text += f" Fix: {self.fix}"
        return " ".join(text.split())  # one line, whatever the parts held
