#!/usr/bin/env bash
# On the GPU machine's bare image (no network): install the wheels scripts/gpu_wheels.sh
# carried in .gpu_wheels/ into .gpu_site/, with no dependencies and no index, and use the
# image's own torch. Prints the lines to source, so that `python3 -m hpc_ddp...` and
# `make run` work there:
#
#   eval "$(scripts/gpu_bootstrap.sh)"      # sets PYTHONPATH and HPC_DDP_PYTHON
#
# hpc_ddp itself needs no install: the repository is on PYTHONPATH (its conf/ is found
# beside the package). Exit 1, with the reason on stderr, when something is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
target="${GPU_SITE:-$PWD/.gpu_site}"   # where the wheels go (a test gives its own)
wheels="${GPU_WHEELS:-.gpu_wheels}"
if [ ! -d "$wheels" ] || ! ls "$wheels"/*.whl >/dev/null 2>&1; then
    echo "no .gpu_wheels/ here: run scripts/gpu_wheels.sh where the registry answers, and" \
         "carry .gpu_wheels to this machine" >&2
    exit 1
fi
"$py" -m pip install --quiet --no-deps --no-index --upgrade --target "$target" \
    "$wheels"/*.whl >&2
site="$target:$PWD"
PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" "$py" -c '
import sys
import hostlist, hydra, omegaconf, submitit  # the carried wheels
import hpc_ddp
print("bootstrap:", sys.version.split()[0], "hydra", hydra.__version__, "submitit",
      submitit.__version__, file=sys.stderr)
' >&2
echo "export PYTHONPATH=$site\${PYTHONPATH:+:\$PYTHONPATH}"
echo "export HPC_DDP_PYTHON=$(command -v "$py")"
