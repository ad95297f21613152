"""A script run as a module (``script='-m tests.usercode.script_mod'``): it records what it was
given, as a torchrun-style script would see it."""

import json
import os
import sys

import torch.distributed as dist

if __name__ == "__main__":
    dist.init_process_group("gloo")
    out = sys.argv[1]
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as handle:
        json.dump({"name": __name__, "argv": sys.argv, "rank": os.environ["RANK"],
                   "world": os.environ["WORLD_SIZE"],
                   "data_root": os.environ.get("HPC_DDP_DATA_ROOT")}, handle)
    dist.destroy_process_group()
