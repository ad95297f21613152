#!/usr/bin/env bash
# Install (once) and run the main job: python -m hpc_ddp.submit with any overrides given.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
exec .venv/bin/python -m hpc_ddp.submit "$@"
