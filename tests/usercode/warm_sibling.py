"""Imported by warm_facts.py from its own folder: how many times this module's code ran in
this process (a module left in the warm process by an earlier run would not run again)."""

import builtins

IMPORTS = getattr(builtins, "_warm_sibling_imports", 0) + 1
builtins._warm_sibling_imports = IMPORTS  # type: ignore[attr-defined]
