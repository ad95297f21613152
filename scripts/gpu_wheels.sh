#!/usr/bin/env bash
# Prepare .gpu_wheels/: the pure-Python packages hpc_ddp needs that the lent GPU machine's
# image lacks (submitit, hydra-core, omegaconf, antlr4-python3-runtime, python-hostlist,
# cloudpickle), one version each, as wheels for its Python 3.12 on x86-64, without their
# dependencies. The image brings torch, torchvision, numpy, tensorboard, rich, psutil,
# matplotlib, PyYAML, Pillow (docs/performance.md, "Running the GPU check"). Run it here,
# where the package registry answers; the device machine cannot reach one.
#
#   scripts/gpu_wheels.sh            # then: device run, carry [".gpu_wheels"]
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${GPU_WHEELS:-.gpu_wheels}"   # where the wheels go (a test gives its own)
py="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
# The direct dependencies at pyproject.toml's pins, and antlr4 at the version hydra-core
# 1.3 needs (4.9.*).
pins=$("$py" - <<'PY'
import re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
wanted = ("submitit", "hydra-core", "omegaconf", "python-hostlist", "cloudpickle")
print(" ".join(d for d in deps if re.split(r"[=<>]", d)[0] in wanted))
PY
)
transitive="antlr4-python3-runtime==4.9.3"
rm -rf "$dest" && mkdir -p "$dest"
echo "wheels for Python 3.12 into $dest: $pins $transitive" >&2
# Wheels where PyPI has them (py3-none-any) ...
"$py" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --abi cp312 --platform manylinux2014_x86_64 --platform any \
    -d "$dest" $(echo $pins $transitive | tr ' ' '\n' | grep -v -e antlr4 -e hostlist)
# ... and the two published as source only, built here (pure Python: any Python 3 reads them).
"$py" -m pip wheel --quiet --no-deps -w "$dest" \
    $(echo $pins $transitive | tr ' ' '\n' | grep -e antlr4 -e hostlist)
ls "$dest"
count=$(ls "$dest"/*.whl | wc -l)
[ "$count" -eq 6 ] || { echo "expected 6 wheels, got $count" >&2; exit 1; }
