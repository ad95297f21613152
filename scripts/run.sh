#!/usr/bin/env bash
# Install (once) and run the main job: python -m hpc_ddp.submit with any overrides given.
# HPC_DDP_PYTHON=<interpreter that already has the stack> (a container image, the GPU
# machine after scripts/gpu_bootstrap.sh) runs with it and installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${HPC_DDP_PYTHON:-}" ]; then
  exec "$HPC_DDP_PYTHON" -m hpc_ddp.submit "$@"
fi
scripts/bootstrap.sh
exec .venv/bin/python -m hpc_ddp.submit "$@"
