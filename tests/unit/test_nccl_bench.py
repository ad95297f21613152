"""The comm benchmark's pure parts: sizes, nccl-tests' bus factors, the TCP ratio, the table."""

from __future__ import annotations

import argparse

import pytest

from hpc_ddp.bench import tcp
from hpc_ddp.bench.__main__ import SUBCOMMANDS
from hpc_ddp.bench.comm import CommOptions, bus_factor, parse_size, ratio, sizes, table


@pytest.mark.parametrize("text, nbytes", [("1024", 1024), ("1K", 1024), ("4MiB", 4 * 2**20),
                                          ("256M", 256 * 2**20), ("1gib", 2**30)])
def test_parse_size(text: str, nbytes: int) -> None:
    assert parse_size(text) == nbytes


def test_parse_size_refuses_junk() -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size("4 parsecs")


def test_default_sizes_are_1k_to_256m_doubling() -> None:
    got = sizes(CommOptions())
    assert got[0] == 1024 and got[-1] == 256 * 2**20 and len(got) == 19
    assert sizes(CommOptions(min_bytes=1024, max_bytes=4096)) == [1024, 2048, 4096]


@pytest.mark.parametrize("op, world, factor", [
    ("all_reduce", 2, 1.0), ("all_reduce", 8, 1.75), ("all_gather", 8, 0.875),
    ("reduce_scatter", 4, 0.75), ("all_reduce", 1, 0.0)])
def test_bus_factor_is_nccl_tests(op: str, world: int, factor: float) -> None:
    assert bus_factor(op, world) == pytest.approx(factor)


def test_peer_is_on_another_host() -> None:
    assert tcp.pick_peer(["a", "a", "b", "b"]) == 2
    assert tcp.pick_peer(["a", "a"]) == 1
    assert tcp.pick_peer(["a"]) is None


def result() -> dict:  # type: ignore[type-arg]
    rows = [{"op": "all_reduce", "bytes": b, "count": b // 4, "iters": 5, "time_us": t,
             "algbw_gbps": bw, "busbw_gbps": bw * 1.5, "correct": True}
            for b, t, bw in ((2**20, 1000.0, 1.0), (2**21, 1500.0, 1.4), (2**22, 4000.0, 1.2))]
    return {"world_size": 4, "hosts": ["n1", "n1", "n2", "n2"], "backend": "gloo",
            "device": "cpu", "rows": rows,
            "tcp": {"from_host": "n1", "to_host": "n2", "seconds": 2.0, "gbps": 3.0,
                    "same_host": False}}


def test_ratio_at_the_largest_and_the_best_size() -> None:
    r = ratio(result())
    assert r is not None
    assert r["all_reduce"]["bytes"] == 2**22 and r["all_reduce"]["ratio"] == pytest.approx(0.6)
    assert r["all_reduce"]["peak_bytes"] == 2**21
    assert r["all_reduce"]["peak_ratio"] == pytest.approx(0.7)
    assert ratio({**result(), "tcp": None}) is None


def test_table() -> None:
    data = result()
    data["ratio"] = ratio(data)
    text = table(data)
    assert "raw TCP n1 -> n2, one stream for 2.0s: 3.000 GB/s" in text
    assert "gloo all_reduce busbw at 4 MiB: 1.800 GB/s = 0.60 x raw TCP" in text
    assert text.splitlines()[0].split()[:2] == ["op", "size"]


def test_comm_is_registered_as_a_benchmark() -> None:
    module, what = SUBCOMMANDS["comm"]
    assert module == "hpc_ddp.bench.comm" and "busbw" in what
