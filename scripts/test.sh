#!/usr/bin/env bash
# The whole test suite: unit, local end-to-end, and the real Slurm cluster tests.
# As root it installs the Debian packages the test cluster needs (slurm, munge, mariadb,
# podman) if they are missing; without root the cluster tests skip with a message (they FAIL under CI=true).
set -euo pipefail
cd "$(dirname "$0")/.."
began=$SECONDS  # the install phase: Debian's packages and the venv
pkgs="slurmctld slurmd slurm-client slurmdbd munge mariadb-server"
# Podman for the container tests (tests/cluster/test_containers.py): runc, since crun 1.8
# refuses this machine's hybrid cgroups; no recommends (buildah, slirp4netns...: unused).
container_pkgs="podman runc"
# OpenSSH for the login node of the remote-submission tests (tests/cluster/test_remote.py).
ssh_pkgs="openssh-server openssh-client"
if [ "$(id -u)" = 0 ] && ! dpkg -s $pkgs $container_pkgs $ssh_pkgs >/dev/null 2>&1; then
  echo "installing Debian packages for the test cluster: $pkgs $container_pkgs $ssh_pkgs" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq $pkgs >/dev/null
  apt-get install -y -qq --no-install-recommends $container_pkgs $ssh_pkgs >/dev/null
fi
# Four pytest-xdist workers: two chains of cluster modules, each on a test cluster of its own
# (gw0: the default cluster, gw1: instance 1), and the unit and local tests on the other two
# (one's test may wait, as the search benchmark's sleeping trials do, while the other's
# computes) and, once their chain is done, on the first two; a later -n in the arguments wins
# (-n 0: one process, one cluster; -n 2: one chain). See tests/conftest.py.
workers=(-n "${HPC_DDP_TEST_WORKERS:-4}" --dist loadscope)
if [ -n "${HPC_DDP_PYTHON:-}" ]; then  # an interpreter that has the stack (see run.sh)
  "$HPC_DDP_PYTHON" -c "import xdist" 2>/dev/null || workers=()
  exec "$HPC_DDP_PYTHON" -m pytest "${workers[@]}" "$@"
fi
scripts/bootstrap.sh test
echo "test.sh: environment ready in $((SECONDS - began))s (install phase)" >&2
exec .venv/bin/python -m pytest "${workers[@]}" "$@"
