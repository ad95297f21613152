"""Throughput: the ranks' own time rides the loop's periodic all-reduce, and the one rank
behind is named from its sums; FLOPs counted without touching the model or the random
streams."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hpc_ddp.trainer import throughput

RANK = textwrap.dedent("""
    import json, sys
    import torch, torch.distributed as dist
    from hpc_ddp.rank.services import window_sync
    rank, world, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank,
                            world_size=world)
    own = 0.9 if rank == 2 else 0.5                     # rank 2 is the slow one
    slow_above = 0.55                                   # 10 % above the last window's mean
    red = window_sync.start(1.0, 2, 8, None, torch.device("cpu"), step=10, epoch=0, lr=0.1,
                            elapsed_s=1.0, log=True, own_s=own, slow=own > slow_above,
                            rank=rank)
    sums = red.result()
    print(json.dumps(sums._asdict()))
    dist.destroy_process_group()
""")


def test_the_rank_behind_is_named_from_the_sums(tmp_path: Path) -> None:
    world = 3
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(r), str(world),
                               str(tmp_path / "store")], stdout=subprocess.PIPE, text=True)
             for r in range(world)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    sums = json.loads(outs[0])
    assert sums["samples"] == 24 and sums["own_s"] == pytest.approx(1.9)
    found = throughput.straggler(sums["own_s"], sums["slow"], sums["slow_rank"],
                                 sums["slow_own_s"], world, steps=10)
    assert found is not None and found.rank == 2
    assert found.behind == pytest.approx(0.9 / 0.5 - 1)
    assert found.own_ms == pytest.approx(90) and found.others_ms == pytest.approx(50)


@pytest.mark.parametrize("slow, own, expected", [
    (0, 0.0, None),           # nobody behind
    (2, 1.8, None),           # two behind: no single rank to name
    (1, 0.52, None),          # behind the last window's mean, but within 10 % of the others
])
def test_no_straggler_named(slow: int, own: float, expected: None) -> None:
    assert throughput.straggler(0.5 * 3 + own, slow, 2.0 * slow, own, 4, 1) is expected


def test_a_straggler_is_named_when_it_stays_behind() -> None:
    watch = throughput.Stragglers()
    three = throughput.Straggler(3, 12.0, 10.0, world_size=8)
    assert watch.confirmed(three) is None  # one window: noise, maybe
    assert watch.confirmed(throughput.Straggler(5, 12.0, 10.0, world_size=8)) is None
    assert watch.confirmed(three) is None  # rank 5 was the one before
    assert watch.confirmed(three) is three  # twice in a row: named
    assert watch.confirmed(None) is None and watch.confirmed(three) is None


def test_with_two_ranks_the_other_is_named() -> None:
    text = throughput.Straggler(1, 13.0, 10.0, "node2", world_size=2).text()
    assert text.startswith("rank 1 on node2 is 30% behind rank 0 (13.0 ms vs 10.0 ms")
    assert "the others" in throughput.Straggler(1, 13.0, 10.0, "node2", world_size=4).text()


def test_flops_counted_without_touching_state() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.5),
                                torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(3)
    flops = throughput.count_flops(model, torch.randn(5, 8), torch.device("cpu"), None)
    drawn = torch.rand(1)
    torch.manual_seed(3)
    torch.randn(5, 8)
    assert torch.equal(drawn, torch.rand(1))  # the dropout drew nothing from the stream
    # forward: 2*8*16 + 2*16*4 multiply-adds per sample; training: three times that
    assert flops == pytest.approx(3 * (2 * 8 * 16 + 2 * 16 * 4))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.training
    assert throughput.peak_flops(torch.device("cpu"), True) is None


def test_a_cpu_clock_counts_batch_waits_and_forwards() -> None:
    import time

    clock = throughput.RankClock(torch.device("cpu"))

    def slow_batches():  # type: ignore[no-untyped-def]
        for i in range(2):
            time.sleep(0.05)
            yield i

    for _ in clock.batches(slow_batches()):
        clock.forward_begins()
        time.sleep(0.02)
        clock.forward_ends()
    own = clock.take()
    assert own >= 2 * 0.05 + 2 * 0.02 and clock.take() == 0.0
