"""Judge what every rank reported (pure): which nodes differ, which are broken, and why.

Input: one ``facts`` dict per rank (``probe.collect`` plus the all-reduce result). Two kinds
of check:

- consistency: a value that must be equal on every node (versions, GPU models, ACTIVE IB
  ports, peer memory, the effective NCCL environment). The value most nodes have is taken as
  right (a tie goes to rank 0's node); every other node is named with its value.
- per node: what is wrong on a node by itself (a filter that selects nothing there, ports
  down, two ranks on one GPU, a wrong all-reduce result).

A problem that every node of a multi-node job shares is a configuration problem, not a node
problem: it fails the verdict but no node is named for exclusion.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from hpc_ddp.rank.join.device import collisions
from hpc_ddp.rank.join.nccl import FAIL, WARN

Facts = dict[str, Any]


def node_label(facts: Facts, hosts_with_several_nodes: set[str]) -> str:
    """The node a rank ran on: its host, or host#node for simulated nodes of a local run."""
    host = str(facts["host"])
    return f"{host}#{facts['node_rank']}" if host in hosts_with_several_nodes else host


def group_by_node(all_facts: list[Facts]) -> dict[str, list[Facts]]:
    """node label -> its ranks' facts, in rank order (nodes in order of their first rank)."""
    node_ranks: dict[str, set[int]] = {}
    for f in all_facts:
        node_ranks.setdefault(str(f["host"]), set()).add(int(f["node_rank"]))
    several = {h for h, n in node_ranks.items() if len(n) > 1}
    nodes: dict[str, list[Facts]] = {}
    for f in sorted(all_facts, key=lambda f: int(f["rank"])):
        nodes.setdefault(node_label(f, several), []).append(f)
    return nodes


def _active(f: Facts) -> list[str]:
    return [p["name"] for p in f["node"]["ib_ports"] if p["state"] == "ACTIVE"]


def _configured_env(f: Facts) -> dict[str, str]:
    detected = f.get("detected", {})
    return {k: v for k, v in f["env"].items() if k not in detected}


#: (what, value per rank, level when nodes differ). What nccl.detect chose per node may
#: differ by design (it adapts to each node), hence only a warning; the hardware facts behind
#: such a difference (ACTIVE ports, peer memory) fail on their own.
CONSISTENT: list[tuple[str, Callable[[Facts], Any], str]] = [
    ("Python", lambda f: f["python"], FAIL),
    ("torch", lambda f: f["torch"], FAIL),
    ("CUDA (torch build)", lambda f: f["cuda"], FAIL),
    ("NCCL", lambda f: f["nccl"], FAIL),
    ("cuDNN", lambda f: f["cudnn"], FAIL),
    ("GPU models", lambda f: sorted(set(f["gpu"]["names"] or [])), FAIL),
    ("GPUs visible per task", lambda f: f["gpu"]["count"], FAIL),
    ("ACTIVE IB ports", _active, FAIL),
    ("GPUDirect peer memory", lambda f: f["node"]["peermem"], FAIL),
    ("NCCL environment", _configured_env, FAIL),
    ("settings nccl.detect chose", lambda f: f.get("detected", {}), WARN),
]


def _show(value: Any) -> str:
    if value is None or value == [] or value == "":
        return "none"
    if isinstance(value, list):
        return ",".join(map(str, value))
    return str(value)


def _env_diff(value: dict[str, str], reference: dict[str, str], others: int) -> str:
    keys = sorted(k for k in set(value) | set(reference) if value.get(k) != reference.get(k))
    return "; ".join(
        f"{k}={value.get(k, '(unset)')} here, {reference.get(k, '(unset)')} on the other "
        f"{others} node(s)" for k in keys)


def _problem(level: str, check: str, hosts: list[str], message: str) -> dict[str, Any]:
    return {"level": level, "check": check, "hosts": hosts, "message": message}


def consistency(nodes: dict[str, list[Facts]]) -> list[dict[str, Any]]:
    problems = []
    first_node = next(iter(nodes))
    for what, get, level in CONSISTENT:
        per_node: dict[str, Any] = {}
        for label, ranks in nodes.items():
            values = [get(f) for f in ranks]
            if any(v != values[0] for v in values):
                problems.append(_problem(FAIL, what, [label], f"{what} differs between its "
                                         "ranks: " + " / ".join(map(_show, values))))
            per_node[label] = values[0]
        counts = Counter(repr(v) for v in per_node.values())
        if len(counts) < 2:
            continue
        top = max(counts.values())
        candidates = [r for r, c in counts.items() if c == top]
        reference_repr = (repr(per_node[first_node]) if repr(per_node[first_node]) in candidates
                          else candidates[0])
        reference = next(v for v in per_node.values() if repr(v) == reference_repr)
        others = sum(1 for v in per_node.values() if repr(v) == reference_repr)
        for label, value in per_node.items():
            if repr(value) == reference_repr:
                continue
            shown = (_env_diff(value, reference, others) if isinstance(value, dict)
                     else f"{_show(value)} here, {_show(reference)} on the other {others} "
                     "node(s)")
            problems.append(_problem(level, what, [label], f"{what}: {shown}"))
    return problems


def per_node(nodes: dict[str, list[Facts]], context: dict[str, Any]) -> list[dict[str, Any]]:
    problems = []
    for label, ranks in nodes.items():
        seen: set[str] = set()
        for f in ranks:  # what the rank's effective environment gets wrong on its node
            for level, text in f.get("warnings", []):
                if text not in seen:
                    seen.add(text)
                    problems.append(_problem(level, "NCCL settings", [label], text))
        first = ranks[0]
        ports = first["node"]["ib_ports"]
        if ports and not _active(first):
            disabled = first["env"].get("NCCL_IB_DISABLE") == "1"
            down = ", ".join(f"{p['name']} {p['state']}" for p in ports)
            problems.append(_problem(
                WARN if disabled else FAIL, "IB ports", [label],
                f"no IB port is ACTIVE ({down})" + (
                    "; NCCL_IB_DISABLE=1, so NCCL uses sockets" if disabled else
                    "; NCCL would try verbs and fail. Check the cable/switch port "
                    "(ibstat) or exclude the node")))
        gpus = first["gpu"]["names"] or []
        if gpus and _active(first) and not first["node"]["peermem"]:
            problems.append(_problem(WARN, "GPUDirect RDMA", [label], (
                "IB is ACTIVE but no peer-memory module (nvidia_peermem) is loaded: "
                "inter-node traffic is staged through host memory")))
        problems += _gpu_checks(label, ranks, context)
        wrong = [str(f["rank"]) for f in ranks if not f["allreduce"]["correct"]]
        if wrong:
            problems.append(_problem(FAIL, "all-reduce result", [label],
                                     f"rank(s) {', '.join(wrong)} got a wrong sum"))
    return problems


def _gpu_checks(label: str, ranks: list[Facts], context: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    cuda = [f for f in ranks if f["gpu"]["device"].startswith("cuda")]
    owners: dict[str, list[str]] = {}
    for f in cuda:
        # Without a UUID, the index means something only with the visible-device list
        # (under --gpus-per-task every rank's device is cuda:0, each a different GPU).
        gpu = f["gpu"]
        key = gpu["uuid"] or f"{gpu['device']} of CUDA_VISIBLE_DEVICES={gpu['visible']}"
        owners.setdefault(key, []).append(str(f["rank"]))
    for shared, on in owners.items():
        if len(on) > 1:
            out.append(_problem(FAIL, "one task per GPU", [label],
                                f"ranks {', '.join(on)} share GPU {shared}"))
    visible = ranks[0]["gpu"]["count"]
    if cuda and context.get("gpu_binding") != "per_task" and visible > len(ranks):
        out.append(_problem(WARN, "one task per GPU", [label],
                            f"{visible} GPUs visible, {len(ranks)} task(s): "
                            f"{visible - len(ranks)} GPU(s) idle"))
    if not cuda and context.get("gpus_per_node"):
        out.append(_problem(WARN, "one task per GPU", [label],
                            "GPUs were requested but the ranks run on CPU "
                            "(trainer.device=cpu)"))
    return out


def software(nodes: dict[str, list[Facts]], context: dict[str, Any]) -> list[dict[str, Any]]:
    """The nodes whose packages differ from the others' (the rendezvous' fingerprint, rank
    0's finding) and every node's drift from environment.yml's pins."""
    out = []
    labels = {str(f["host"]): label for label, ranks in nodes.items() for f in ranks}
    for entry in context.get("software_mixed", []):
        host, _, what = str(entry).partition(": ")
        out.append(_problem(FAIL, "software", [labels.get(host, host)],
                            f"differs from the other nodes: {what}"))
    for label, ranks in nodes.items():
        for what in ranks[0].get("drift", []):
            out.append(_problem(WARN, "environment.yml", [label], f"drift: {what}"))
    return out


def bandwidth(allreduce: dict[str, Any], context: dict[str, Any]) -> list[dict[str, Any]]:
    floor = context.get("min_busbw_gbps")
    if floor and allreduce["busbw_gbps"] < floor:
        return [_problem(FAIL, "all-reduce bandwidth", [], (
            f"all-reduce busbw {allreduce['busbw_gbps']:.2f} GB/s is below the required "
            f"{floor:g} GB/s"))]
    return []


def merged(problems: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per distinct finding, naming every node that has it."""
    out: dict[tuple[str, str, str], dict[str, Any]] = {}
    for p in problems:
        key = (p["level"], p["check"], p["message"])
        if key in out:
            out[key]["hosts"] += [h for h in p["hosts"] if h not in out[key]["hosts"]]
        else:
            out[key] = {**p, "hosts": list(p["hosts"])}
    return list(out.values())


def _scope(problem: dict[str, Any], nodes: dict[str, list[Facts]]) -> str:
    """"job" (fix the configuration or the job) or "node" (exclude the named nodes)."""
    hosts = set(problem["hosts"])
    if not hosts:
        return "job"
    if len(nodes) > 1:
        return "job" if hosts == set(nodes) else "node"
    # One node: a setting that does not fit it is the configuration's fault; broken
    # hardware or software on it is the node's.
    return "job" if problem["check"] == "NCCL settings" else "node"


def analyse(all_facts: list[Facts], context: dict[str, Any]) -> dict[str, Any]:
    """The report: nodes (label -> ranks), problems, bad nodes, the all-reduce, the verdict."""
    nodes = group_by_node(all_facts)
    allreduce = all_facts[0]["allreduce"]
    gpu_map = [f["placement"] for f in sorted(all_facts, key=lambda f: int(f["rank"]))
               if f.get("placement", {}).get("physical") is not None]
    shared = [_problem(FAIL, "one task per GPU", [c["host"]],
                       f"ranks {', '.join(map(str, c['ranks']))} are given GPU {c['gpu']}")
              for c in collisions(gpu_map)]
    problems = merged(consistency(nodes) + per_node(nodes, context) + software(nodes, context)
                      + bandwidth(allreduce, context) + shared)
    for p in problems:
        p["scope"] = _scope(p, nodes)
    bad = [label for label in nodes if any(
        p["level"] == FAIL and p["scope"] == "node" and label in p["hosts"] for p in problems)]
    return {
        "ok": not any(p["level"] == FAIL for p in problems),
        "nodes": {label: [int(f["rank"]) for f in ranks] for label, ranks in nodes.items()},
        "bad_nodes": bad,
        "problems": problems,
        "allreduce": allreduce,
        "world_size": len(all_facts),
        "gpu_map": gpu_map,
        "facts": sorted(all_facts, key=lambda f: int(f["rank"])),
        "context": context,
    }
