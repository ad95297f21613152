"""A job that can never start: refused before sbatch from one sinfo (only what Slurm would
never run), or explained from its pending reason; sbatch's refusals name the key."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from hpc_ddp.config.compose import compose
from hpc_ddp.config.schema import ClusterConfig, Config
from hpc_ddp.launch.resolve import resolve
from hpc_ddp.slurm import fit as slurm_fit
from hpc_ddp.slurm.fit import NodeGroup, Partition, Request, parse_sinfo, problem
from hpc_ddp.slurm.reasons import explain
from tests.unit.slurm_records import (
    SBATCH_CPUS,
    SBATCH_FEATURE,
    SBATCH_MEMORY,
    SBATCH_NODE_CONFIG,
    SBATCH_NODE_NAME,
    SBATCH_OPTION,
    SBATCH_PARTITION,
    SINFO_2205,
    calls,
    fake_slurm,
)

TEST_CLUSTER = parse_sinfo(SINFO_2205)
# Said when no partition is named: a site's job_submit plugin may route a job to any.
ALSO = "; no other partition here can run it either"
# A site with several partitions, nodes of several shapes and other versions' GRES text
# (typed GPUs with socket affinity, shards), a default that is not the first line, limits.
SITE = parse_sinfo("""cpu|120|64|256000|(null)|2-00:00:00|1-32|c[001-120]
gpu*|16|64|512000|gpu:a100:4(S:0-1)|1-00:00:00|1-infinite|g[01-16]
gpu*|2|128|1024000|gpu:a100:8(S:0-1),shard:16|1-00:00:00|1-infinite|g[17-18]
debug|2|8|16000|gpu:tesla:1|30:00|1-1|d[1-2]
""")


def cfg_of(nodes: int = 1, **cluster: Any) -> Config:
    """A Slurm config as submit hands it on (tasks per node derived: one per GPU, else 1),
    built without Hydra so that these tests take milliseconds; test_request_of_a_config
    goes through compose and resolve."""
    extra = cluster.pop("sbatch_extra", {})
    gpus = cluster.get("gpus_per_node") or 0
    c = replace(ClusterConfig(kind="slurm"), **{"tasks_per_node": gpus or 1, **cluster})
    return replace(Config(), nodes=nodes, cluster=replace(c, sbatch_extra=extra))


def refused(parts: dict[str, Partition], nodes: int = 1, environ: dict[str, str] | None = None,
            **cluster: Any) -> str | None:
    error = problem(Request.of(cfg_of(nodes, **cluster), environ or {}), parts)
    return error.message if error else None


def test_request_of_a_config() -> None:
    cfg = resolve(compose(["cluster=slurm", "nodes=2", "cluster.gpus_per_node=2",
                           "cluster.mem_gb=4", "cluster.partition=gpu", "cluster.time_min=30",
                           "+cluster.sbatch_extra.dependency=afterok:7",
                           "+cluster.sbatch_extra.overc=true"]), {}, Path.cwd())
    request = Request.of(cfg, {"SBATCH_TIMELIMIT": "10"})
    assert request == Request(2, 2, 1, 4.0, 2, 30, "gpu", "cluster.partition", None, None,
                              None, "afterok:7", frozenset({"cpus", "time"}))
    assert request.mem_mb == 4096 and request.cpus_per_node == 2


def test_sinfo_lines_are_partitions_of_node_groups() -> None:
    normal = TEST_CLUSTER["normal"]
    assert normal.default and not TEST_CLUSTER["urgent"].default
    assert normal.total_nodes == 4 and normal.max_time_min is None and normal.max_nodes is None
    assert normal.groups == (NodeGroup(4, 2, 3000, 2, "node[1-4]"),)
    gpu = SITE["gpu"]
    assert gpu.default and gpu.total_nodes == 18 and gpu.max_time_min == 24 * 60
    assert [g.gpus for g in gpu.groups] == [4, 8]
    assert SITE["cpu"].max_nodes == 32 and SITE["cpu"].groups[0].gpus == 0
    assert SITE["debug"].max_time_min == 30 and SITE["debug"].max_nodes == 1


@pytest.mark.parametrize("text, minutes", [
    ("infinite", None), ("UNLIMITED", None), ("30", 30), ("45:00", 45), ("0:30", 1),
    ("1:30:00", 90), ("1-00:00:00", 1440), ("2-12", 3600), ("7-00:00", 10080), ("N/A", None),
])
def test_time_limits(text: str, minutes: int | None) -> None:
    assert slurm_fit.minutes(text) == minutes


@pytest.mark.parametrize("asks, start", [
    ({"nodes": 8}, "nodes=8: can never start: partition normal has 4 nodes, the job asks "
                   f"for 8{ALSO}. Fix: nodes=4"),
    ({"cpus_per_task": 4}, "cluster.cpus_per_task=4: can never start: no node of partition "
                           f"normal has 4 CPUs per node (the most is 2){ALSO}. Fix: "
                           "cluster.cpus_per_task=2"),
    ({"tasks_per_node": 2, "cpus_per_task": 2},
     "cluster.cpus_per_task=2: can never start: no node of partition normal has "
     "cluster.tasks_per_node=2 x cluster.cpus_per_task=2 = 4 CPUs per node"),
    ({"mem_gb": 8.0}, "cluster.mem_gb=8.0: can never start: no node of partition normal has "
                      f"8192 MB of memory (the most is 3000 MB){ALSO}. Fix: cluster.mem_gb=2.9"),
    ({"gpus_per_node": 4}, "cluster.gpus_per_node=4: can never start: no node of partition "
                           "normal has 4 GPUs (the most is 2)"),
    ({"partition": "gpu"}, "cluster.partition=gpu: no such partition on this cluster (sinfo "
                           "lists normal, urgent)"),
])
def test_what_no_node_of_the_test_cluster_can_run(asks: dict[str, Any], start: str) -> None:
    message = refused(TEST_CLUSTER, **asks)
    assert message is not None and message.startswith(start), message


@pytest.mark.parametrize("asks", [
    {"nodes": 4}, {"nodes": 4, "cpus_per_task": 2}, {"mem_gb": 2.5}, {"gpus_per_node": 2},
    {"partition": "urgent", "nodes": 4},
    {"time_min": 100000},  # MaxTime=INFINITE
    # Relaxed by options sinfo cannot judge: overcommit, another cluster.
    {"cpus_per_task": 4, "sbatch_extra": {"overcommit": "true"}},
    {"nodes": 8, "sbatch_extra": {"clusters": "other"}},
])
def test_what_the_test_cluster_can_run_is_never_refused(asks: dict[str, Any]) -> None:
    assert refused(TEST_CLUSTER, **asks) is None


def test_environment_variables_that_override_the_script() -> None:
    assert refused(TEST_CLUSTER, 8, {"SBATCH_CLUSTERS": "other"}) is None
    assert refused(TEST_CLUSTER, 1, {"SBATCH_MEM_PER_CPU": "1G"}, mem_gb=8.0) is None
    said = refused(TEST_CLUSTER, 2, {"SBATCH_PARTITION": "gpu"})
    assert said is not None and said.startswith("SBATCH_PARTITION (environment)=gpu")


def test_a_site_with_several_partitions_and_node_shapes() -> None:
    assert refused(SITE, 18, gpus_per_node=4) is None  # the default partition: gpu
    said = refused(SITE, 4, gpus_per_node=8)
    assert said is not None and said.startswith(
        "nodes=4: can never start: only 2 of partition gpu's 18 nodes have 8 CPUs and 8 GPUs, "
        f"the job asks for 4 such nodes{ALSO}. Fix: nodes=2"), said
    assert refused(SITE, 2, gpus_per_node=8) is None
    said = refused(SITE, partition="cpu", gpus_per_node=1)
    assert said is not None and "choose a partition with GPUs" in said
    # Limits of the partition: refused unless a QOS is named (one may exceed them).
    said = refused(SITE, 64, partition="cpu")
    assert said is not None and "allows at most 32 nodes per job (MaxNodes)" in said
    said = refused(SITE, partition="debug", time_min=60)
    assert said is not None and said.startswith(
        "cluster.time_min=60: can never start: partition debug allows at most 30 minutes "
        "(MaxTime), the job asks for 60. Fix: cluster.time_min=30")
    assert refused(SITE, partition="debug", time_min=60, qos="long") is None
    # Several partitions: refused only when none of them can run it.
    assert refused(SITE, partition="debug,gpu", gpus_per_node=4) is None
    assert refused(SITE, partition="debug,cpu", gpus_per_node=4) is not None


def test_unknown_is_never_refused() -> None:
    no_default = {k: v for k, v in TEST_CLUSTER.items() if k != "normal"}
    assert refused(no_default, 4) is None  # the default partition is not known
    # ... but a job larger than every partition can start nowhere (nodes=1000000000).
    assert refused(no_default, 1_000_000_000) == (
        "nodes=1000000000: can never start: the largest partition of this cluster (urgent) "
        "has 4 nodes. Fix: nodes=4 or fewer.")
    assert refused({}, 8) is None
    empty = {"cloud": Partition("cloud", True, groups=(NodeGroup(0, None, None, 0),))}
    assert refused(empty, 8) is None  # nodes yet to come
    # No partition named, the default has no GPUs, another has: a job_submit plugin may
    # route the job there (many sites do), so only a job no partition can run is refused.
    routed = parse_sinfo("cpu*|100|64|256000|(null)|infinite|1-infinite|c[1-100]\n"
                         "gpu|8|64|512000|gpu:4|infinite|1-infinite|g[1-8]\n")
    assert refused(routed, 2, gpus_per_node=4) is None
    said = refused(routed, 2, gpus_per_node=8)  # said about the partition that comes closest
    assert said is not None and said.startswith(
        f"cluster.gpus_per_node=8: can never start: no node of partition gpu has 8 GPUs (the "
        f"most is 4){ALSO}. Fix: cluster.gpus_per_node=4 or fewer"), said
    assert refused(routed, 2, partition="cpu", gpus_per_node=4) is not None


def test_one_sinfo_for_a_whole_sweep(tmp_path: Path) -> None:
    folder, log = fake_slurm(tmp_path / "bin", {"sinfo": SINFO_2205})
    base = cfg_of()
    cfgs = [replace(base, trainer=replace(base.trainer, seed=i)) for i in range(300)]
    cfgs.append(cfg_of(8))
    with pytest.raises(Exception) as info:
        slurm_fit.check(cfgs, {"PATH": str(folder)}, [str(i) for i in range(301)])
    assert "(sweep point 300) can never start: partition normal has 4 nodes" in str(info.value)
    assert calls(log) == [f"sinfo -a -e -h -o {slurm_fit.SINFO_FORMAT}"]
    slurm_fit.check(cfgs[:300], {"PATH": str(tmp_path / "empty")})  # no sinfo: no refusal


def lazy(parts: dict[str, Partition] | None):  # type: ignore[no-untyped-def]
    return lambda: parts


@pytest.mark.parametrize("reason, asks, never, words", [
    ("PartitionNodeLimit", {"nodes": 8}, True,
     "can never start (PartitionNodeLimit): partition normal has 4 nodes, the job asks for "
     "8: nodes=4"),
    ("PartitionNodeLimit", {"nodes": 4}, False, "not enough of its nodes are up"),
    # 22.05 says PartitionConfig for the same job at times (seen on the test cluster).
    ("PartitionConfig", {"nodes": 8}, True, "partition normal has 4 nodes, the job asks for "
                                            "8: nodes=4"),
    ("PartitionConfig", {"nodes": 2}, True, "does not fit partition normal's configuration"),
    ("PartitionTimeLimit", {"time_min": 600}, True, "cluster.time_min=600 is above"),
    ("DependencyNeverSatisfied", {"dependency": "afterok:12"}, True,
     "(cluster.sbatch_extra.dependency=afterok:12) failed or was cancelled: cancel this one"),
    ("BadConstraints", {"constraint": "a100"}, True, "cluster.constraint=a100"),
    ("QOSMaxNodePerJobLimit", {}, True, "per-job limit of its QOS"),
    ("AssocMaxCpuPerNode", {}, True, "per-job limit"),
    ("QOSMinCpuNotSatisfied", {}, True, "per-job limit"),
    ("InvalidQOS", {"qos": "gold"}, True, "cluster.qos=gold is not valid"),
    ("QOSGrpNodeLimit", {}, False, "usage limit"),
    ("QOSMaxJobsPerUserLimit", {}, False, "usage limit"),
    ("MaxCpuPerAccount", {}, False, "usage limit"),
    ("JobHeldUser", {}, False, "waits (JobHeldUser): held: it starts once released"),
    ("Resources", {}, False, "waits (Resources): for nodes to free up"),
    # No reason (yet): Slurm's "None" is not news, and never shown as a reason.
    ("None", {}, False, "waits: for the scheduler's next pass"),
    ("", {}, False, "waits: for the scheduler's next pass"),
    ("ReqNodeNotAvail, UnavailableNodes:node9", {"nodelist": "node9"}, True,
     "it requires node(s) node9, which the cluster does not have"),
    ("ReqNodeNotAvail, UnavailableNodes:node3", {"nodelist": "node3"}, False,
     "down, drained or reserved (node3)"),
])
def test_pending_reasons_in_our_words(reason: str, asks: dict[str, Any], never: bool,
                                      words: str) -> None:
    # The partition is squeue's (slurm_reasons.pending_of): where the job waits.
    pending = explain(reason, Request(**{"nodes": 1, "partition": "normal", **asks}),
                      lazy(TEST_CLUSTER))
    assert pending.never is never
    assert words in pending.line(), pending.line()


def test_a_reason_needing_facts_asks_for_them_only_then() -> None:
    asked: list[int] = []

    def facts() -> dict[str, Partition]:
        asked.append(1)
        return TEST_CLUSTER

    request = Request(nodes=8, partition="normal")
    explain("JobHeldUser", request, facts)
    explain("Priority", request, facts)
    assert asked == []
    assert explain("PartitionNodeLimit", request, facts).never and asked
    # Without the facts (no sinfo), PartitionNodeLimit may be "down nodes": not "never".
    assert not explain("PartitionNodeLimit", request, lazy(None)).never
    # The time limit needs no facts to mean "never"; with them it says the figure.
    figures = {"normal": Partition("normal", True, 120, groups=TEST_CLUSTER["normal"].groups)}
    timed = explain("PartitionTimeLimit", Request(1, time_min=600), lazy(figures))
    assert timed.line().endswith("partition normal allows at most 120 minutes (MaxTime), "
                                 "the job asks for 600: cluster.time_min=120")


@pytest.mark.parametrize("stderr, asks, start", [
    (SBATCH_CPUS, {"cpus_per_task": 4},
     "cluster.cpus_per_task=4: sbatch refused the job: CPU count per node can not be "
     "satisfied; Batch job submission failed: Requested node configuration is not available."),
    (SBATCH_MEMORY, {"mem_gb": 8.0}, "cluster.mem_gb=8.0: sbatch refused the job: Memory"),
    (SBATCH_PARTITION, {"partition": "gpu"}, "cluster.partition=gpu: sbatch refused the job: "
     "invalid partition specified: gpu; Batch job submission failed: Invalid partition"),
    (SBATCH_FEATURE, {"constraint": "a100"}, "cluster.constraint=a100: sbatch refused"),
    (SBATCH_NODE_NAME, {"nodelist": "node9"}, "cluster.nodelist=node9: sbatch refused"),
    (SBATCH_NODE_CONFIG, {"gpus_per_node": 4}, "cluster.gpus_per_node=4: sbatch"),
    (SBATCH_NODE_CONFIG, {"nodes": 3, "exclude": "node1,node2"},
     "cluster.exclude=node1,node2: sbatch refused"),
    (SBATCH_NODE_CONFIG, {}, "cluster=(default partition): sbatch refused"),  # nothing set
    (SBATCH_OPTION, {"sbatch_extra": {"foo": "1"}},
     "cluster.sbatch_extra.foo=1: sbatch refused the job: unrecognized option '--foo=1'"),
])
def test_sbatch_refusals_name_the_key(tmp_path: Path, stderr: str, asks: dict[str, Any],
                                      start: str) -> None:
    from submitit.core.utils import FailedJobError

    from hpc_ddp.slurm.refusal import refusal

    folder, _ = fake_slurm(tmp_path / "bin", {"scontrol": "Slurmctld(primary) at ctl is UP",
                                              "sbatch": ""})
    error = refusal(cfg_of(**asks), FailedJobError(stderr), {"PATH": str(folder)})
    assert error is not None and error.message.startswith(start), error and error.message
    assert "\n" not in error.message and "Fix: " in error.message


def test_a_node_configuration_refusal_is_diagnosed_with_sinfo(tmp_path: Path) -> None:
    from submitit.core.utils import FailedJobError

    from hpc_ddp.slurm.refusal import refusal

    folder, _ = fake_slurm(tmp_path / "bin", {"scontrol": "Slurmctld(primary) at ctl is UP",
                                              "sbatch": "", "sinfo": SINFO_2205})
    # sbatch refuses "normal,urgent" with 8 nodes outright (seen on the test cluster).
    cfg = cfg_of(8, partition="normal,urgent")
    error = refusal(cfg, FailedJobError(SBATCH_NODE_CONFIG), {"PATH": str(folder)})
    assert error is not None and error.message.startswith(
        "nodes=8: sbatch refused the job: Batch job submission failed: Requested node "
        "configuration is not available (partition normal has 4 nodes, the job asks for 8; "
        "neither can urgent). Fix: nodes=4"), error and error.message
