#!/usr/bin/env bash
# The GPU checks of the performance work, in one go, in under 8 minutes on one GPU:
#   1. tests/gpu (NCCL, placement, pinned batches, bf16, channels_last, fused optimizer,
#      torch.compile, CUDA-event timing, exact stretches of steps, resume, fp16)  <= 2.5 min
#   2. the training benchmark, 1 rank: null, tiny_cnn, resnet18 at 32x32        <= 2 min
#   3. resnet50 at 224x224, bf16 + channels_last against the plain loop         <= 2.5 min
#   4. your code on CUDA/NCCL: a function entry, and a torchrun-style script under
#      script= against the same script under torchrun (samples/s)              <= 1 min
# Each step has its own timeout (8 min in all), so a slow one cannot eat the others' time;
# its seconds are in the summary.
#      (target on an H200: >= 3000 img/s; docs/performance.md)
# Everything lands in $OUT (the device machine's result folder) or ./gpu_results:
# summary.txt first, then each step's full output and the benchmarks' JSON and PNG.
#
#   scripts/gpu_check.sh            # from the repository root
set -uo pipefail

cd "$(dirname "$0")/.."
out="${OUT:-./gpu_results}"
mkdir -p "$out"
summary="$out/summary.txt"
: >"$summary"
if [ -n "${PYTHON:-}" ]; then py="$PYTHON"
elif [ -x .venv/bin/python ]; then py=.venv/bin/python
else py=python3
fi
say() { echo "$*" | tee -a "$summary"; }
step_start=$SECONDS
lap() { local s=$((SECONDS - step_start)); step_start=$SECONDS; echo "${s}s"; }

say "gpu_check $(date -u +%FT%TZ) on $(hostname), python: $py"
nvidia-smi >"$out/nvidia-smi.txt" 2>&1 && head -15 "$out/nvidia-smi.txt" >>"$summary"
if ! "$py" -c 'import torch, hpc_ddp; assert torch.cuda.is_available(), "no CUDA"' \
        >"$out/env.txt" 2>&1; then
    say "environment not usable (torch with CUDA and hpc_ddp importable?):"
    cat "$out/env.txt" | tee -a "$summary"
    exit 1
fi
"$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
"device", torch.cuda.get_device_name(0), "bf16", torch.cuda.is_bf16_supported())' \
    | tee -a "$summary"
status=0

# 1. The GPU tests (they skip nothing here: CUDA is present).
timeout 150 "$py" -m pytest -q -rA tests/gpu -p no:cacheprovider \
    --junitxml="$out/gpu-tests.xml" >"$out/gpu-tests.txt" 2>&1
rc=$?; [ $rc -ne 0 ] && status=1
say "tests/gpu: exit $rc in $(lap) ($(tail -1 "$out/gpu-tests.txt"))"

# 2. Small models, one rank per GPU (the bench's default grid), 32x32.
timeout 120 "$py" -m hpc_ddp.bench.train --models null,tiny_cnn,resnet18 --rounds 3 \
    --window-s 1 cluster=local cluster.tasks_per_node=1 cluster.gpus_per_node=1 \
    cluster.cpus_per_task=8 trainer.batch_size=256 run_dir="$out/bench-32px" \
    >"$out/bench-32px.txt" 2>&1
rc=$?; [ $rc -ne 0 ] && status=1
say "bench 32x32: exit $rc in $(lap)"
grep -E '^(model|null|tiny_cnn|resnet18) |^target|^framework' "$out/bench-32px.txt" \
    | tee -a "$summary"

# 3. ResNet-50 at 224x224: the plain fp32 loop, the tuned defaults (deterministic, as a run
#    trains by default) and the tuned defaults without determinism (cuDNN autotuning).
timeout 150 "$py" -m hpc_ddp.bench.train --models resnet50 --rounds 3 --window-s 3 \
    --settings tuned --variant 'tuned_nondet:tuned trainer.deterministic=false' \
    cluster=local cluster.tasks_per_node=1 cluster.gpus_per_node=1 cluster.cpus_per_task=8 \
    data.image_size=224 data.train_size=2048 data.eval_size=64 trainer.batch_size=256 \
    run_dir="$out/bench-resnet50-224px" >"$out/bench-resnet50-224px.txt" 2>&1
rc=$?; [ $rc -ne 0 ] && status=1
say "bench resnet50 224x224: exit $rc in $(lap)"
grep -E '^(model|resnet50) |^target' "$out/bench-resnet50-224px.txt" | tee -a "$summary"
("$py" - "$out/bench-resnet50-224px/bench/train.json" <<'EOF'
import json, sys
try:
    rows = json.load(open(sys.argv[1]))["rows"]
except (OSError, ValueError, KeyError) as exc:
    sys.exit(f"resnet50 target: no result ({exc})")
best = max((r for r in rows if r["setting"] != "baseline"), key=lambda r: r["samples_per_s"])
verdict = "met" if best["samples_per_s"] >= 3000 else "NOT met"
print(f"resnet50 224x224 {best['setting']}: {best['samples_per_s']:.0f} img/s "
      f"(target >= 3000 on an H200): {verdict}")
EOF
) 2>&1 | tee -a "$summary"

# 4. Your code on the GPU: a function entry (NCCL process group, torchrun variables) and the
#    textbook script under script= and under torchrun, one rank each.
timeout 60 bash -c '
  "$0" -m hpc_ddp.submit cluster=local cluster.gpus_per_node=1 \
      entry=tests.usercode.entries:report run_dir="$1/entry" &&
  "$0" -c "import json,sys; r=json.load(open(sys.argv[1]))[\"result\"]; print(\"function entry:\", r)" \
      "$1/entry/summary.json" &&
  "$0" -m hpc_ddp.submit cluster=local cluster.gpus_per_node=1 \
      script=hpc_ddp/bench/ddp_script.py run_dir="$1/script" -- --steps 300 \
      --out "$1/script.json" &&
  "$0" -m torch.distributed.run --nproc-per-node=1 hpc_ddp/bench/ddp_script.py \
      --steps 300 --out "$1/torchrun.json" &&
  "$0" -c "import json,sys; a,b=(json.load(open(p))[\"samples_per_s\"] for p in sys.argv[1:]);
print(f\"script= {a:.0f} samples/s vs torchrun {b:.0f}: ratio {a/b:.3f} (target >= 0.99)\")" \
      "$1/script.json" "$1/torchrun.json"' "$py" "$out" >"$out/your-code.txt" 2>&1
rc=$?; [ $rc -ne 0 ] && status=1
say "your code (entry, script): exit $rc in $(lap)"
grep -E '^(function entry|script=)' "$out/your-code.txt" | tee -a "$summary"

say "gpu_check done: exit $status; results in $out"
exit $status
