#!/usr/bin/env bash
# The GPU checks, in one go, in at most 10 minutes on one GPU, from the lent machine's bare
# image (docs/performance.md, "Running the GPU check"):
#   0. bootstrap: the carried wheels (.gpu_wheels, scripts/gpu_wheels.sh) into .gpu_site,
#      the image's own torch                                                    ~10 s
#   1. `make run` as a new user types it: one rank on the GPU, NCCL            <= 40 s
#   2. tests/gpu (NCCL, placement, pinned batches, bf16, channels_last, fused optimizer,
#      torch.compile, CUDA-event timing, exact stretches of steps, resume, fp16) <= 2 min
#   3. a 1-rank NCCL run stopped mid-way (SIGTERM: checkpoint) and resumed       <= 50 s
#   4. the training benchmark, 1 rank: null, tiny_cnn, resnet18 at 32x32         <= 1.5 min
#   5. resnet50 at 224x224, bf16 + channels_last against the plain loop          <= 100 s
#      (target on an H200: >= 3000 img/s)
#   6. your code: a function entry, and a torchrun-style script under script=
#      against the same script under torchrun (samples/s, target ratio >= 0.99)  <= 1 min
#   7. the combination matrix's sharded rows on CUDA, bf16 (tests/integration/
#      test_matrix.py: every model x sgd/adamw under fsdp, and ctx.shard)        <= 2.3 min
# Each step has its own timeout, so a slow one cannot eat the others' time; its seconds are
# in the summary. $OUT (the device machine's result folder, else ./gpu_results) gets 8
# files at most: summary.txt (torch version, every figure, every target met or not) and one
# log per step; run folders go to a temporary directory.
#
#   scripts/gpu_check.sh            # from the repository root
#   scripts/gpu_check.sh --cpu      # the same commands on a machine without a GPU (steps
#                                   # 2, 4, 5 skipped, nothing judged): what CI runs, so that
#                                   # only CUDA itself is left untried for the device
set -uo pipefail
cpu=0; [ "${1:-}" = --cpu ] && cpu=1
# Timeouts keep the device's 10 minutes; with --cpu (the suite, at nice 10 on 2 cores beside
# the test cluster's jobs at nice 0: a tenth of a core at times, tests/conftest.py's
# LOCAL_NICE) the same steps get 10 times as long, nothing being budgeted.
slow=1; [ $cpu = 1 ] && slow=10
t() { echo $(( $1 * slow )); }
# Steps of the resume run (stopped at a quarter: enough that the stop lands before the end
# even on a fast GPU) and of the script runs; on CPU, where nothing is measured, fewer
# (the resume's 240 steps still leave ~180 after a stop asked for at step 60).
resume_steps=600; script_steps=300
[ $cpu = 1 ] && resume_steps=240 && script_steps=20

cd "$(dirname "$0")/.."
out="${OUT:-./gpu_results}"
mkdir -p "$out"
work=$(mktemp -d /tmp/hpc_ddp_gpu_check.XXXXXX)
summary="$out/summary.txt"
: >"$summary"
say() { echo "$*" | tee -a "$summary"; }
step_start=$SECONDS
lap() { local s=$((SECONDS - step_start)); step_start=$SECONDS; echo "${s}s"; }
status=0
ran() { local rc=$1 name=$2; [ "$rc" -ne 0 ] && status=1; say "$name: exit $rc in $(lap)"; }

say "gpu_check $(date -u +%FT%TZ) on $(hostname)"
# 0. The stack: the venv here, or the image's python plus the carried wheels there.
if [ -n "${PYTHON:-}" ]; then py="$PYTHON"
elif [ -x .venv/bin/python ]; then py=.venv/bin/python
else
    if ! boot=$(scripts/gpu_bootstrap.sh 2>"$out/setup.txt"); then
        say "bootstrap failed:"; tee -a "$summary" <"$out/setup.txt"; exit 1
    fi
    eval "$boot"
    py="$HPC_DDP_PYTHON"
fi
export HPC_DDP_PYTHON="$py"
if ! "$py" -c "import torch, hpc_ddp; assert $cpu or torch.cuda.is_available(), 'no CUDA'" \
        >>"$out/setup.txt" 2>&1; then
    say "environment not usable (torch with CUDA and hpc_ddp importable?):"
    tee -a "$summary" <"$out/setup.txt"
    exit 1
fi
"$py" -c 'import sys, torch; cuda = torch.cuda.is_available(); print("python",
sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "device",
torch.cuda.get_device_name(0) if cuda else "none", "bf16", cuda and torch.cuda.is_bf16_supported())' \
    | tee -a "$summary"
[ $cpu = 1 ] && say "--cpu: no GPU asked for; targets are not judged"
[ $cpu = 1 ] || nvidia-smi --query-gpu=name,memory.total,driver_version \
    --format=csv,noheader >>"$summary" 2>&1
lap >/dev/null

# 1. The first run, exactly as a new user types it (no overrides): one rank on the GPU.
#    (scripts/run.sh is what `make run` runs, for an image without make.)
first="make run"; command -v make >/dev/null || first=scripts/run.sh
before=$(ls outputs 2>/dev/null)
# As a new user's shell: no make variables inherited from an outer make (CI runs this check
# under `make test ARGS=...`; make exports command-line variables, ARGS included, to recipes).
timeout $(t 40) env -u MAKEFLAGS -u MFLAGS -u MAKELEVEL -u ARGS $first >"$out/make-run.txt" 2>&1
ran $? "$first"
grep -m1 '^hpc_ddp:' "$out/make-run.txt" | tee -a "$summary"
made=$(comm -13 <(echo "$before") <(ls outputs 2>/dev/null) | head -1)  # this check's run
"$py" - "outputs/$made/summary.json" <<'EOF' 2>&1 | tee -a "$summary"
import json, sys
try:
    s = json.load(open(sys.argv[1]))
except (OSError, ValueError) as exc:
    sys.exit(f"make run: no summary ({exc})")
ok = s["world_size"] == 1 and s["device"].startswith("cuda")
print(f"make run: {s['world_size']} rank on {s['device']}, {s['global_step']} steps, eval "
      f"accuracy {s['eval_accuracy']:.3f}, {s['samples_per_s']:.0f} samples/s: "
      f"{'met' if ok else 'NOT met'} (one rank on the GPU)")
EOF
[ -n "$made" ] && rm -rf "outputs/$made"

# 2. The GPU tests (they skip nothing here: CUDA is present).
if [ $cpu = 0 ]; then
timeout $(t 120) "$py" -m pytest -q -rA tests/gpu -p no:cacheprovider >"$out/gpu-tests.txt" 2>&1
ran $? "tests/gpu"
tail -1 "$out/gpu-tests.txt" | tee -a "$summary"
fi

# 3. Stopped mid-way by SIGTERM (the ranks agree, checkpoint, stop), then resumed.
timeout $(t 50) "$py" - "$work/resume" "$resume_steps" >"$out/resume.txt" 2>&1 <<'EOF'
import sys, time
import hpc_ddp
steps = int(sys.argv[2])
args = ["cluster=local", f"trainer.max_steps={steps}",
        f"trainer.checkpoint_interval={steps // 6}", f"run_dir={sys.argv[1]}"]
run = hpc_ddp.submit(args)
while (run.progress() or {}).get("step", 0) < steps // 4:
    time.sleep(0.1)
run.cancel(grace_s=30)
stopped = (run.progress() or {}).get("step")
summary = hpc_ddp.submit([*args, "resume=true"]).wait(progress=False)
ok = summary["global_step"] == steps and summary["resumed_from_step"] == stopped
print(f"resume: stopped at step {stopped}, resumed from {summary['resumed_from_step']}, "
      f"ended at {summary['global_step']} on {summary['device']}: {'met' if ok else 'NOT met'}")
sys.exit(0 if ok else 1)
EOF
ran $? "stop and resume"
grep '^resume:' "$out/resume.txt" | tee -a "$summary"

# 4. Small models, one rank per GPU (the bench's default grid), 32x32.
if [ $cpu = 0 ]; then
timeout $(t 90) "$py" -m hpc_ddp.bench.train --models null,tiny_cnn,resnet18 --rounds 3 \
    --window-s 1 cluster=local cluster.tasks_per_node=1 cluster.gpus_per_node=1 \
    cluster.cpus_per_task=8 trainer.batch_size=256 run_dir="$work/bench-32px" \
    >"$out/bench-32px.txt" 2>&1
ran $? "bench 32x32"
grep -E '^(model|null|tiny_cnn|resnet18) |^target|^framework' "$out/bench-32px.txt" \
    | tee -a "$summary"

# 5. ResNet-50 at 224x224: the plain fp32 loop, the tuned defaults (deterministic, as a run
#    trains by default) and the tuned defaults without determinism (cuDNN autotuning).
timeout $(t 100) "$py" -m hpc_ddp.bench.train --models resnet50 --rounds 3 --window-s 3 \
    --settings tuned --variant 'tuned_nondet:tuned trainer.deterministic=false' \
    cluster=local cluster.tasks_per_node=1 cluster.gpus_per_node=1 cluster.cpus_per_task=8 \
    data.image_size=224 data.train_size=2048 data.eval_size=64 trainer.batch_size=256 \
    run_dir="$work/bench-resnet50-224px" >"$out/bench-resnet50-224px.txt" 2>&1
ran $? "bench resnet50 224x224"
grep -E '^(model|resnet50) |^target' "$out/bench-resnet50-224px.txt" | tee -a "$summary"
("$py" - "$work/bench-resnet50-224px/bench/train.json" <<'EOF'
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
else
say "tests/gpu, bench 32x32, bench resnet50 224x224: skipped (--cpu)"
fi

# 6. Your code on the GPU: a function entry (NCCL process group, torchrun variables) and the
#    textbook script under script= and under torchrun, one rank each (60 s in all).
{
  timeout $(t 20) "$py" -m hpc_ddp.submit cluster=local cluster.tasks_per_node=1 \
      entry=tests.usercode.entries:report run_dir="$work/entry" &&
  timeout $(t 20) "$py" -m hpc_ddp.submit cluster=local cluster.tasks_per_node=1 \
      script=hpc_ddp/bench/ddp_script.py run_dir="$work/script" -- --steps $script_steps \
      --out "$work/script.json" &&
  timeout $(t 20) "$py" -m torch.distributed.run --nproc-per-node=1 hpc_ddp/bench/ddp_script.py \
      --steps $script_steps --out "$work/torchrun.json"
} >"$out/your-code.txt" 2>&1
ran $? "your code (entry, script)"
"$py" - "$work" <<'EOF' 2>&1 | tee -a "$summary" | tee -a "$out/your-code.txt"
import json, sys
from pathlib import Path
work = Path(sys.argv[1])
try:
    result = json.loads((work / "entry" / "summary.json").read_text())["result"]
    print(f"function entry: backend {result['backend']}, RANK={result['env_rank']}, "
          f"WORLD_SIZE={result['env_world']}, MASTER_ADDR={result['master']}")
    ours, bare = (json.loads((work / f).read_text())["samples_per_s"]
                  for f in ("script.json", "torchrun.json"))
except (OSError, ValueError, KeyError) as exc:
    sys.exit(f"your code: no result ({exc})")
ratio = ours / bare
print(f"script= {ours:.0f} samples/s vs torchrun {bare:.0f}: ratio {ratio:.3f} "
      f"(target >= 0.99): {'met' if ratio >= 0.99 else 'NOT met'}")
EOF

# 7. The combination matrix's sharded rows (tests/integration/test_matrix.py) on the GPU: every
#    built-in model (timm too: the image has it) x sgd/adamw under trainer.strategy=fsdp at the
#    default precision (bf16 on CUDA), and a user's loop with ctx.shard; one rank, NCCL; each
#    trained, stopped, resumed and compared bitwise with the uninterrupted run.      <= 2.3 min
if [ $cpu = 0 ]; then
HPC_DDP_MATRIX_DEVICE=cuda timeout $(t 135) "$py" -m pytest -q -rA -p no:cacheprovider \
    tests/integration/test_matrix.py -k "(test_trains_stops and fsdp and auto) or ctx.shard" \
    >"$work/matrix-fsdp.txt" 2>&1
ran $? "matrix: fsdp rows on CUDA"
grep -E "^(PASSED|FAILED|ERROR|SKIPPED)" "$work/matrix-fsdp.txt" | sed 's/^/  /' | tee -a "$summary"
tail -1 "$work/matrix-fsdp.txt" | tee -a "$summary"
# Its log after the GPU tests' (8 files at most come back)
{ echo; echo "=== matrix: fsdp rows on CUDA"; cat "$work/matrix-fsdp.txt"; } >>"$out/gpu-tests.txt"
fi

say "gpu_check done: exit $status in ${SECONDS}s; results in $out"
rm -rf "$work"
exit $status
