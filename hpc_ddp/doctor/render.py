"""The doctor's report as text: a per-node table, the problems, and a verdict with the exact
``cluster.exclude=...`` to resubmit with."""

from __future__ import annotations

from typing import Any

import hostlist

from hpc_ddp.rank.join.nccl import FAIL


def exclude_override(bad: list[str], already: str | None) -> str:
    """``cluster.exclude='<hostlist>'`` covering ``bad`` and what was excluded already,
    quoted for Hydra (brackets and commas need the quotes)."""

    hosts = [h.split("#", 1)[0] for h in bad]  # simulated nodes share their host
    if already:
        hosts = hostlist.expand_hostlist(already) + hosts
    return f"cluster.exclude='{hostlist.collect_hostlist(sorted(set(hosts)))}'"


def _short_gpus(first: dict[str, Any]) -> str:
    names = first["gpu"]["names"] or []
    if not names:
        return "none" if first["gpu"]["device"] == "cpu" else first["gpu"]["device"]
    kinds = sorted(set(names))
    return ", ".join(f"{names.count(k)}x {k.removeprefix('NVIDIA ')}" for k in kinds)


def _ports(first: dict[str, Any]) -> str:
    ports = first["node"]["ib_ports"]
    if not ports:
        return "none"
    return ", ".join(f"{p['name']} {p['state']}" for p in ports)


def table(report: dict[str, Any]) -> str:
    """One row per node: ranks, versions, GPUs, IB ports and states, peer memory, status."""
    facts = {int(f["rank"]): f for f in report["facts"]}
    failing = {h for p in report["problems"] if p["level"] == FAIL for h in p["hosts"]}
    warned = {h for p in report["problems"] for h in p["hosts"]} - failing
    head = ("node", "ranks", "python", "torch", "cuda", "nccl", "cudnn", "gpus", "ib ports",
            "peermem", "status")
    rows = [head]
    for label, ranks in report["nodes"].items():
        first = facts[ranks[0]]
        status = "FAIL" if label in failing else "warn" if label in warned else "ok"
        rows.append((label, _ranks(ranks), first["python"], first["torch"],
                     first["cuda"] or "-", first["nccl"] or "-", str(first["cudnn"] or "-"),
                     _short_gpus(first), _ports(first), first["node"]["peermem"] or "-", status))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in rows)


def _ranks(ranks: list[int]) -> str:
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def summary(report: dict[str, Any]) -> str:
    """Table, problems, all-reduce and verdict, as the doctor prints them."""
    ar = report["allreduce"]
    lines = [table(report), ""]
    if report.get("gpu_map"):
        lines.append("rank -> node -> GPU: " + ", ".join(
            f"{m['rank']}->{m['host']}:{m['physical']}" for m in report["gpu_map"]))
        lines.append("")
    for p in report["problems"]:
        where = f"{', '.join(p['hosts'])}: " if p["hosts"] else ""
        lines.append(f"{'FAIL' if p['level'] == FAIL else 'warn'}  [{p['check']}] {where}"
                     f"{p['message']}")
    if report["problems"]:
        lines.append("")
    lines.append(f"all-reduce ({ar['backend']}, {report['world_size']} ranks, "
                 f"{ar['bytes'] / 2**20:g} MiB x {ar['iters']}): {ar['time_s'] * 1e3:.2f} ms, "
                 f"algbw {ar['algbw_gbps']:.3f} GB/s, busbw {ar['busbw_gbps']:.3f} GB/s, "
                 f"result {'correct' if ar['correct'] else 'WRONG'}")
    lines.append(verdict(report))
    return "\n".join(lines)


def verdict(report: dict[str, Any]) -> str:
    if report["ok"]:
        return f"doctor: ok, {len(report['nodes'])} node(s), {report['world_size']} rank(s)."
    bad = report["bad_nodes"]
    text = "doctor: FAIL."
    if bad:
        override = exclude_override(bad, report["context"].get("exclude"))
        text += (f" Bad node(s): {', '.join(bad)}. Resubmit without them (with the same "
                 f"overrides): {override}")
    job_level = [p for p in report["problems"] if p["level"] == FAIL and p["scope"] == "job"]
    if job_level:
        text += (" Every node shares " + ("these problems" if len(job_level) > 1 else
                                          "this problem") +
                 ": fix the configuration or the job, not a node (see docs/nccl.md).")
    return text


def failure_summary(bad: list[str], errors: list[str], exclude: str | None) -> str:
    """When the job failed before rank 0 could judge: what the ranks' errors say."""
    lines = ["doctor: FAIL. The job did not finish; rank errors:"]
    lines += [f"  {e}" for e in errors] or ["  (none recorded; see the submitit logs)"]
    if bad:
        lines.append(f"Bad node(s): {', '.join(bad)}. Resubmit without them (with the same "
                     f"overrides): {exclude_override(bad, exclude)}")
    return "\n".join(lines)
