#!/usr/bin/env bash
# Create .venv and install hpc_ddp into it (editable), with the test tools when asked.
#   scripts/bootstrap.sh          # runtime only
#   scripts/bootstrap.sh test     # + pytest, ruff, mypy
# Idempotent: a venv whose install stamp matches pyproject.toml is reused as is.
set -euo pipefail
cd "$(dirname "$0")/.."
extra=${1:-}
stamp=".venv/.installed-${extra:-runtime}"
# Our own modules' bytecode, as pip compiles an installed package's (an editable install is
# not): every rank, supervisor and command imports ~100 of them, and where the environment
# says PYTHONDONTWRITEBYTECODE (this project's test machines do) Python would compile them
# again in every process. Incremental: only what changed is compiled again.
compile_ours() {
  .venv/bin/python -m compileall -q hpc_ddp tests/usercode examples >/dev/null || true
}
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ]; then
  compile_ours
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
compile_ours
touch "$stamp"
