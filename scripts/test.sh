#!/usr/bin/env bash
# The whole test suite: unit, local end-to-end, and the real Slurm cluster tests.
# As root it installs the Debian packages the test cluster needs (slurm, munge, mariadb) if
# they are missing; without root the cluster tests skip with a message (they FAIL under CI=true).
set -euo pipefail
cd "$(dirname "$0")/.."
pkgs="slurmctld slurmd slurm-client slurmdbd munge mariadb-server"
if [ "$(id -u)" = 0 ] && ! dpkg -s $pkgs >/dev/null 2>&1; then
  echo "installing Debian packages for the test cluster: $pkgs" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq $pkgs >/dev/null
fi
if [ -n "${HPC_DDP_PYTHON:-}" ]; then  # an interpreter that has the stack (see run.sh)
  exec "$HPC_DDP_PYTHON" -m pytest "$@"
fi
began=$SECONDS
scripts/bootstrap.sh test
echo "test.sh: environment ready in $((SECONDS - began))s" >&2
exec .venv/bin/python -m pytest "$@"
