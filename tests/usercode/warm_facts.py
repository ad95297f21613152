"""A script that writes what a fresh interpreter would show it (tests/integration/
test_warm_start.py): run as ``python warm_facts.py OUT [args]``, directly or forked warm."""

import gc
import json
import os
import signal
import sys

# Before any import of its own: torch already there means a warm start; the script's own
# module (its folder is sys.path[0]) must be imported fresh by every run, warm or not.
torch_preloaded = "torch" in sys.modules
sibling_fresh = "warm_sibling" not in sys.modules
import torch  # noqa: E402
import warm_sibling  # noqa: E402 (the facts are about when it is imported)

facts = {
    "name": __name__,
    "argv": sys.argv,
    "path0": sys.path[0],
    "sibling_fresh": sibling_fresh and warm_sibling.IMPORTS == 1,
    "torch_preloaded": torch_preloaded,
    "main_is_me": sys.modules["__main__"].__dict__ is globals(),
    "rank": os.environ.get("RANK"),
    "cuda_visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
    "threads": torch.get_num_threads(),
    "affinity": sorted(os.sched_getaffinity(0)),
    "sigint_ignored": signal.getsignal(signal.SIGINT) == signal.SIG_IGN,
    "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
    "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
    "own_group": os.getpgid(0) == os.getpid(),
    "note": os.environ.get("HPC_DDP_WARM_NOTE", ""),
    "cwd": os.getcwd(),
    "cuda_initialized": torch.cuda.is_initialized(),
    "gc_enabled": gc.isenabled(),
    "cmdline": " ".join(w for w in open("/proc/self/cmdline").read().split("\0") if w),
}
with open(sys.argv[1], "w") as out:
    json.dump(facts, out)
if len(sys.argv) > 2 and sys.argv[2] == "raise":
    raise ValueError("the script's own error")
if len(sys.argv) > 2 and sys.argv[2] == "wait":
    signal.pause()
sys.exit(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
