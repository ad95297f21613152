#!/usr/bin/env bash
# Create .venv and install hpc_ddp into it (editable), with the test tools when asked.
#   scripts/bootstrap.sh          # runtime only
#   scripts/bootstrap.sh test     # + pytest, ruff, mypy
# Idempotent: a venv whose install stamp matches pyproject.toml is reused as is.
set -euo pipefail
cd "$(dirname "$0")/.."
extra=${1:-}
stamp=".venv/.installed-${extra:-runtime}"
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ]; then
  exit 0
fi
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
target="."
[ -n "$extra" ] && target=".[${extra}]"
echo "installing hpc_ddp${extra:+ with [$extra]} into .venv (torch takes about a minute) ..." >&2
.venv/bin/python -m pip install --quiet -e "$target"
touch "$stamp"
