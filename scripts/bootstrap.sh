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
# pip compiles what it installs one file at a time (~45 s of a ~100 s install here, torch's
# ~15,000 modules); compileall over the same folders with a process per core makes the same
# bytecode (~26 s on 2 cores).
.venv/bin/python -m pip install --quiet --no-compile -e "$target"
.venv/bin/python - <<'PY' | sort -u | while read -r folder; do
import sysconfig
for key in ("purelib", "platlib"):
    print(sysconfig.get_paths()[key])
PY
  .venv/bin/python -m compileall -q -j 0 "$folder" >/dev/null || true
done
compile_ours
touch "$stamp"
