"""A torchrun-style script given a secret argument (``--hf-token VALUE`` and a bare token): it
writes, to the file its first argument names (outside the run dir), the SHA-256 of what it
received and which command lines of this node hold a planted value ($PLANTED_FILE)."""

import hashlib
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist
from entries import command_lines_holding  # beside this script, as a user's own module


def main() -> None:
    out, args = sys.argv[1], sys.argv[2:]
    dist.init_process_group("gloo")  # through the supervisor's store, which needs its key
    planted = json.loads(Path(os.environ["PLANTED_FILE"]).read_text())
    holding = command_lines_holding(list(planted.values()))
    token = args[args.index("--hf-token") + 1]
    Path(f"{out}.{dist.get_rank()}").write_text(json.dumps({
        "hf_token": hashlib.sha256(token.encode()).hexdigest(),
        "bare": hashlib.sha256(args[-1].encode()).hexdigest(), "argv_holding": holding}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
