"""The doctor's judgement (pure): which node differs, which is broken, what to exclude."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from hpc_ddp.doctor import job, render
from hpc_ddp.doctor.checks import analyse

ACTIVE = {"name": "mlx5_0:1", "hca": "mlx5_0", "port": 1, "state": "ACTIVE",
          "link_layer": "InfiniBand", "rate": ""}


def rank_facts(rank: int, host: str, node_rank: int | None = None,
               **changes: Any) -> dict[str, Any]:
    facts: dict[str, Any] = {
        "rank": rank, "local_rank": 0, "node_rank": rank if node_rank is None else node_rank,
        "local_world_size": 1, "host": host, "python": "3.11.7", "torch": "2.14.1+cu130",
        "cuda": "13.0", "nccl": "2.30.7", "cudnn": 92400,
        "gpu": {"device": "cuda:0", "count": 1, "names": ["NVIDIA H200"], "uuid": f"GPU-{host}",
                "visible": "0"},
        "node": {"ib_ports": [dict(ACTIVE)], "interfaces": [], "peermem": "nvidia_peermem",
                 "gpus": ["NVIDIA H200"], "root": "/", "notes": []},
        "env": {"NCCL_IB_HCA": "=mlx5_0:1"}, "warnings": [],
        "allreduce": {"bytes": 1024, "iters": 5, "time_s": 0.001, "algbw_gbps": 1.0,
                      "busbw_gbps": 1.5, "correct": True, "backend": "nccl"},
    }
    for key, value in changes.items():
        target, _, leaf = key.partition("__")
        if leaf:
            facts[target][leaf] = value
        else:
            facts[key] = value
    return facts


CTX: dict[str, Any] = {"gpu_binding": "per_node", "gpus_per_node": 1, "exclude": None}


def cluster(n: int = 4, **bad: Any) -> list[dict[str, Any]]:
    """n healthy one-rank nodes node1..nodeN; ``bad`` changes apply to node3."""
    return [rank_facts(i, f"node{i + 1}", **(bad if i == 2 else {})) for i in range(n)]


def test_healthy_cluster_is_ok() -> None:
    report = analyse(cluster(), CTX)
    assert report["ok"] and report["bad_nodes"] == [] and report["problems"] == []
    assert report["nodes"] == {"node1": [0], "node2": [1], "node3": [2], "node4": [3]}


@pytest.mark.parametrize("change, check, words", [
    ({"torch": "2.13.0+cpu"}, "torch", ["2.13.0+cpu here, 2.14.1+cu130 on the other 3"]),
    ({"nccl": "2.21.5"}, "NCCL", ["2.21.5 here"]),
    ({"node__peermem": None}, "GPUDirect peer memory", ["none here"]),
    ({"env": {"NCCL_IB_HCA": "=mlx5_0:1", "NCCL_SOCKET_IFNAME": "eth1"}}, "NCCL environment",
     ["NCCL_SOCKET_IFNAME=eth1 here, (unset) on the other 3 node(s)"]),
    ({"node__ib_ports": [dict(ACTIVE, state="DOWN")]}, "IB ports", ["no IB port is ACTIVE",
                                                                    "mlx5_0:1 DOWN"]),
    ({"warnings": [["fail", "NCCL_SOCKET_IFNAME==ib0 matches no interface"]]},
     "NCCL settings", ["=ib0"]),
    ({"allreduce": {**rank_facts(0, "x")["allreduce"], "correct": False}},
     "all-reduce result", ["rank(s) 2 got a wrong sum"]),
])
def test_one_bad_node_is_named_alone(change: dict[str, Any], check: str,
                                     words: list[str]) -> None:
    report = analyse(cluster(**change), CTX)
    assert not report["ok"] and report["bad_nodes"] == ["node3"]
    hits = [p for p in report["problems"] if p["check"] == check]
    assert hits and all(p["hosts"] == ["node3"] and p["scope"] == "node" for p in hits)
    assert all(w in hits[0]["message"] for w in words), hits
    assert all(p["hosts"] == ["node3"] for p in report["problems"])


def test_majority_decides_and_a_tie_goes_to_rank_0s_node() -> None:
    facts = cluster()
    facts[0]["torch"] = facts[1]["torch"] = "2.13.0"  # two against two: rank 0's side wins
    assert analyse(facts, CTX)["bad_nodes"] == ["node3", "node4"]
    facts[2]["torch"] = "2.13.0"  # three against one
    assert analyse(facts, CTX)["bad_nodes"] == ["node4"]


def test_a_problem_every_node_shares_is_the_configurations() -> None:
    warn = [["fail", "NCCL_SOCKET_IFNAME==ib0 matches no interface on this node (it has eth0)."]]
    facts = [dict(f, warnings=warn) for f in cluster()]
    report = analyse(facts, CTX)
    assert not report["ok"] and report["bad_nodes"] == []
    [problem] = report["problems"]
    assert problem["scope"] == "job" and problem["hosts"] == ["node1", "node2", "node3", "node4"]
    assert "not a node" in render.verdict(report) and "exclude" not in render.verdict(report)


def test_two_ranks_on_one_gpu_and_idle_gpus() -> None:
    shared = [rank_facts(r, "node1", node_rank=0, gpu__uuid="GPU-a", gpu__count=2)
              for r in range(2)]
    problems = analyse(shared, CTX)["problems"]
    assert any("ranks 0, 1 share GPU GPU-a" in p["message"] for p in problems)
    # No UUID: cuda:0 on two ranks that see different GPUs (per-task binding) is fine...
    per_task = [rank_facts(r, "node1", node_rank=0, gpu__uuid=None, gpu__visible=str(r))
                for r in range(2)]
    assert not any("share" in p["message"] for p in analyse(per_task, CTX)["problems"])
    # ...and on two ranks that see the same list it is one GPU.
    same = [rank_facts(r, "node1", node_rank=0, gpu__uuid=None, gpu__visible="0,1")
            for r in range(2)]
    assert any("ranks 0, 1 share GPU cuda:0" in p["message"]
               for p in analyse(same, CTX)["problems"])
    idle = [rank_facts(0, "node1", gpu__count=8)]
    assert any("7 GPU(s) idle" in p["message"] and p["level"] == "warn"
               for p in analyse(idle, CTX)["problems"])


def test_ranks_of_one_node_that_disagree() -> None:
    facts = [rank_facts(0, "node1", node_rank=0), rank_facts(1, "node1", node_rank=0,
                                                             cudnn=91000)]
    report = analyse(facts, CTX)
    assert report["bad_nodes"] == ["node1"]
    assert "differs between its ranks: 92400 / 91000" in report["problems"][0]["message"]


def test_simulated_nodes_of_a_local_run_get_their_own_rows() -> None:
    facts = [rank_facts(r, "laptop", node_rank=r // 2) for r in range(4)]
    assert analyse(facts, CTX)["nodes"] == {"laptop#0": [0, 1], "laptop#1": [2, 3]}


def test_bandwidth_floor() -> None:
    report = analyse(cluster(), {**CTX, "min_busbw_gbps": 10.0})
    assert not report["ok"] and report["bad_nodes"] == []
    assert "below the required 10 GB/s" in report["problems"][0]["message"]


@pytest.mark.parametrize("bad, already, expected", [
    (["node3"], None, "cluster.exclude='node3'"),
    (["node3", "node4"], None, "cluster.exclude='node[3-4]'"),
    (["gpu07"], "gpu[01-02]", "cluster.exclude='gpu[01-02,07]'"),
    (["laptop#1"], None, "cluster.exclude='laptop'"),
])
def test_exclude_override_is_quoted_for_hydra(bad: list[str], already: str | None,
                                              expected: str) -> None:
    assert render.exclude_override(bad, already) == expected


def test_table_has_a_row_per_node() -> None:
    report = analyse(cluster(node__ib_ports=[dict(ACTIVE, state="DOWN")]), CTX)
    text = render.summary(report)
    rows = [line for line in text.splitlines() if line.startswith("node")]
    assert rows[0].split()[:3] == ["node", "ranks", "python"] and len(rows) == 5
    assert "mlx5_0:1 DOWN" in rows[3] and rows[3].endswith("FAIL")
    assert rows[1].endswith("ok") and "1x H200" in rows[1]
    assert text.splitlines()[-1].endswith("cluster.exclude='node3'")


@pytest.mark.parametrize("errors, hosts", [
    # node3 failed on its own; rank 0 then timed out naming it: node3 only.
    ([(2, "node3", "torch sees no CUDA device", 2.0),
      (0, "node1", "1 of 4 ranks never joined the rendezvous within 60s: rank(s) 2 "
                   "(expected on node3).", 3.0)], ["node3"]),
    # Only consequences: rank 0's rendezvous error says where the missing ranks were.
    ([(0, "node1", "2 of 4 ranks never joined the rendezvous within 60s: rank(s) 2 (expected "
                   "on node3), 3 (expected on node4).", 1.0)], ["node3", "node4"]),
    # Connections closed everywhere: the earliest failure is the best guess.
    ([(1, "node2", "Connection closed by peer", 5.0),
      (3, "node4", "Connection reset by peer", 4.0)], ["node4"]),
    ([], []),
])
def test_culprits_from_rank_errors(errors: list[tuple[int, str, str, float]],
                                   hosts: list[str]) -> None:
    assert job.culprit_hosts(copy.deepcopy(errors)) == hosts


def test_what_detection_chose_per_node_only_warns() -> None:
    facts = cluster()
    for f in facts:
        f["detected"] = {"NCCL_SOCKET_IFNAME": "=eth0"}
        f["env"]["NCCL_SOCKET_IFNAME"] = "=eth0"
    facts[2]["detected"] = {"NCCL_SOCKET_IFNAME": "=ens3"}
    facts[2]["env"]["NCCL_SOCKET_IFNAME"] = "=ens3"
    report = analyse(facts, CTX)
    assert report["ok"] and report["bad_nodes"] == []
    [problem] = report["problems"]
    assert problem["level"] == "warn" and problem["hosts"] == ["node3"]
    assert "NCCL_SOCKET_IFNAME==ens3 here, =eth0 on the other 3 node(s)" in problem["message"]


def test_software_that_differs_fails_its_node_and_drift_only_warns() -> None:
    # rank 0's rendezvous finding (envcheck, let through for the doctor) and node3's drift.
    ctx = {**CTX, "software_mixed": ["node3: fake-drift 1.0 (others not installed)"]}
    report = analyse(cluster(drift=["torch 2.14.0 (environment.yml: 2.14.1)"]), ctx)
    assert report["bad_nodes"] == ["node3"] and not report["ok"]
    found = {(p["level"], p["check"], p["message"]) for p in report["problems"]}
    assert ("fail", "software", "differs from the other nodes: fake-drift 1.0 (others not "
            "installed)") in found
    assert ("warn", "environment.yml", "drift: torch 2.14.0 (environment.yml: 2.14.1)") in found
    drifted = analyse(cluster(drift=["numpy 2.0 (environment.yml: 2.4.6)"]), CTX)
    assert drifted["ok"] and drifted["bad_nodes"] == []  # a warning, not a bad node


def test_the_doctor_reads_the_pins_of_environment_yml() -> None:
    from hpc_ddp.doctor import reference_pins

    pins = dict(reference_pins())
    assert pins["torch"] and pins["python"] == "3.11"
