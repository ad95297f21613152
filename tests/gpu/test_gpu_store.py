"""NCCL on the job's own store (rank/join/authstore.py, a Python torch Store): the process
group forms on it, a collective runs, NCCL's watchdog threads (which poll the store from C++
threads, TORCH_NCCL_DUMP_ON_TIMEOUT) find it while the rank idles, and a process that leaves
with the group still up exits cleanly. Skipped without CUDA; scripts/gpu_check.sh runs it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROGRAM = textwrap.dedent("""
    import sys, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    from hpc_ddp.rank.join import authstore

    class Counting(authstore.AuthStore):
        polls = 0

        def check(self, keys):
            Counting.polls += 1
            return super().check(keys)

    key = authstore.new_key()
    server = authstore.StoreServer(key, ["127.0.0.1"])
    store = Counting("127.0.0.1", server.port, key, timedelta(seconds=60), server=server)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=device)
    total = torch.ones(4, device=device)
    dist.all_reduce(total)
    torch.cuda.synchronize()
    time.sleep(float(sys.argv[1]))  # NCCL's monitor polls the store meanwhile, if it does
    print("sum", total.sum().item(), "polls", Counting.polls, flush=True)
    if sys.argv[2] == "destroy":
        dist.destroy_process_group()
""")


@pytest.mark.parametrize("end", ["destroy", "leave"])
def test_nccl_forms_and_runs_on_the_jobs_store(tmp_path: Path, end: str) -> None:
    program = tmp_path / "nccl_store.py"
    program.write_text(PROGRAM)
    done = subprocess.run([sys.executable, str(program), "3", end], cwd=REPO,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "sum 4.0" in done.stdout
    print(done.stdout)  # the number of store polls from NCCL's threads: a figure
