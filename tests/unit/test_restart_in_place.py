"""Restart in place, unit by unit: the supervisors' decision (supervise/generations.py), the
hang watch's limit and its naming of the stuck ranks (supervise/hangs.py), the heartbeat
(services/heartbeat.py) and what failures cost (events.recovery). The whole path runs on the
real cluster: tests/cluster/test_fault_tolerance.py."""

from __future__ import annotations

import re
from typing import Any

import pytest

from hpc_ddp import events
from hpc_ddp.rank.services import heartbeat
from hpc_ddp.rank.supervise import generations as g
from hpc_ddp.rank.supervise import hangs
from hpc_ddp.slurm import driver


def _end(verdict: str, at: float, rank: int, cause: str = "") -> g.End:
    return g.End(verdict, at, -9 if verdict != g.OK else 0, cause, rank, f"node{rank + 1}")


def test_the_earliest_failure_is_the_root_and_the_budget_decides() -> None:
    ends = {0: _end(g.RESTARTABLE, 12.0, 0, "lost peer"), 1: _end(g.RESTARTABLE, 10.0, 1, "KILL"),
            2: _end(g.STOPPED, 13.0, 2)}
    decision = g.decide(ends, generation=0, budget=2)
    assert decision.what == g.RESTART and decision.root is not None
    assert decision.root.rank == 1 and decision.root.cause == "KILL"
    assert g.decide(ends, generation=2, budget=2).what == g.REQUEUE  # the budget is spent
    assert g.decide(ends, generation=0, budget=0).what == g.REQUEUE


def test_a_final_failure_fails_and_a_clean_end_is_done() -> None:
    final = {0: _end(g.OK, 1.0, 0), 1: _end(g.FINAL, 2.0, 1, "ValueError")}
    assert g.decide(final, 0, 3).what == g.FAIL
    assert g.decide({0: _end(g.OK, 1.0, 0), 1: _end(g.OK, 1.0, 1)}, 0, 3).what == g.DONE


def test_a_rank_that_never_reported_is_a_lost_node() -> None:
    decision = g.decide({0: _end(g.RESTARTABLE, 5.0, 0, "lost peer"), 1: None}, 0, 3)
    assert decision.what == g.LOST and decision.missing == (1,)


def test_a_hang_recorded_by_rank_0s_watch_is_the_cause_though_every_rank_was_stopped() -> None:
    stopped = {r: _end(g.STOPPED, 20.0, r) for r in range(3)}
    assert g.decide(stopped, 0, 3).what == g.DONE  # without the record: nothing failed
    hang = g.End(g.RESTARTABLE, 19.0, 0, "hang: ...", 1, "node2", stop_all=True)
    decision = g.decide(stopped, 0, 3, recorded=hang)
    assert decision.what == g.RESTART and decision.root == hang
    assert g.End.from_json(hang.as_json()) == hang
    assert g.Decision.from_json(decision.as_json()) == decision


def test_the_hang_limit_is_the_configured_one_or_derived_from_the_pauses_seen() -> None:
    assert hangs.limit(42.0, 1000.0) == 42.0
    assert hangs.limit(None, 2.0) == hangs.MIN_DERIVED_S  # 5 minutes at least
    assert hangs.limit(None, 120.0) == 1200.0  # a slow evaluation seen: 10x it


def test_the_ranks_outside_a_collective_are_named() -> None:
    places = {0: "wait (rank/services/window_sync.py line 80)",
              1: "__getitem__ (tests/usercode/parts.py line 93)",
              2: "all_reduce (torch/distributed/distributed_c10d.py line 2800)",
              3: None}
    assert hangs.culprits(places) == [1]
    everywhere = {0: "all_reduce (torch/distributed/c10d.py line 1)",
                  1: "backward (torch/autograd/graph.py line 8)"}
    assert hangs.culprits(everywhere) == [0, 1]  # a collective that hangs on every rank


class _Store:
    def __init__(self) -> None:
        self.values: dict[str, str] = {}

    def set(self, key: str, value: str) -> None:
        self.values[key] = value


def test_a_beat_is_one_store_write_at_most_every_interval(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    clock = [100.0]
    monkeypatch.setattr(heartbeat.time, "monotonic", lambda: clock[0])
    store = _Store()
    beat = heartbeat.Heartbeat(store, 3, every_s=5.0)
    beat.beat(1)
    first = store.values[heartbeat.key(3)]
    assert first.split()[0] == "1"
    clock[0] += 4.0
    beat.beat(2)
    assert store.values[heartbeat.key(3)] == first  # not due yet
    clock[0] += 1.0
    beat.beat(3)
    assert store.values[heartbeat.key(3)].split()[0] == "3"
    heartbeat.Heartbeat(None, 0, 5.0).beat(1)  # no supervisor: nothing, no error
    assert heartbeat.interval(None) == heartbeat.BEAT_S and heartbeat.interval(8.0) == 2.0
    # Rank 0's store takes at most STORE_BEATS_PER_S beats a second at any world size; a
    # rank's own cost stays one write per interval; a hang timeout set still bounds it.
    for world in (8, 1024, 8192, 65536):
        every = heartbeat.interval(None, world)
        assert every >= heartbeat.BEAT_S and world / every <= heartbeat.STORE_BEATS_PER_S
    assert heartbeat.interval(None, 8192) < hangs.MIN_DERIVED_S / 4
    assert heartbeat.interval(8.0, 8192) == 2.0


def _events(*kinds_and_fields: tuple[str, dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"kind": kind, **fields} for kind, fields in kinds_and_fields]


def test_what_each_failure_cost() -> None:
    seen = _events(
        ("failure", {"time": 100.0, "rank": 1, "host": "node2", "cause": "died from SIGKILL\n..",
                     "reached": 47, "step": 40}),
        ("restart_in_place", {"time": 101.0, "failed_at": 99.5, "generation": 1}),
        ("recovered", {"time": 109.0, "from_step": 40}),
        ("failure", {"time": 200.0, "rank": 0, "host": "node1", "cause": "hang", "reached": 90}),
        ("requeue", {"time": 201.0}),
        ("nodes_excluded", {"time": 202.0, "nodes": ["node3"]}))
    cost = events.recovery(seen)
    assert cost["restarts_in_place"] == 1 and cost["requeues"] == 1
    assert cost["excluded_nodes"] == ["node3"]
    first, second = cost["failures"]
    assert first["cause"] == "died from SIGKILL" and first["recovered_by"] == "restart_in_place"
    assert first["seconds_to_first_step"] == 9.0 and first["steps_lost"] == 7
    assert second["recovered_by"] == "requeue" and second["seconds_to_first_step"] is None


def test_a_shrink_is_shown_with_the_node_the_world_sizes_and_its_cost() -> None:
    from hpc_ddp.watch.recovery_lines import failure_lines

    seen = _events(
        ("failure", {"time": 100.0, "rank": 3, "host": "node4", "cause": "node lost",
                     "reached": 57}),
        ("node_lost", {"time": 104.0, "nodes": ["node4"]}),
        ("shrink", {"time": 104.5, "lost": ["node4"], "nodes_before": 4, "nodes_after": 3,
                    "world_before": 4, "world_after": 3}),
        ("restart_in_place", {"time": 104.6}),
        ("recovered", {"time": 118.0, "from_step": 50}))
    (shrink,) = events.recovery(seen)["shrinks"]
    assert shrink == {"time": 104.5, "lost": ["node4"], "nodes_before": 4, "nodes_after": 3,
                      "world_before": 4, "world_after": 3, "steps_lost": 7,
                      "seconds_to_first_step": 18.0}
    lines = failure_lines([{"recovery": events.recovery(seen)}])
    said = next(line for line in lines if line.startswith("shrank:"))
    assert "4 -> 3 nodes (world size 4 -> 3)" in said and "after node4 was lost" in said
    assert "7 steps lost, training again 18.0s after the failure" in said


def test_a_start_after_a_failure_is_awaited_as_a_recovery_a_start_after_a_stop_is_not() -> None:
    assert events.after_failure(_events(("failure", {}), ("restart_in_place", {})))
    assert not events.after_failure(_events(("failure", {}), ("recovered", {})))
    assert not events.after_failure(_events(("stop", {}), ("requeue", {})))
    assert not events.after_failure([])


# -- a node lost: the batch script's driver (slurm/driver.py) --------------------------------


def test_the_batch_host_is_the_spare_while_there_is_another() -> None:
    nodes = ["n1", "n2", "n3"]
    assert driver.step_nodes(nodes, [], batch_host="n1", wanted=2) == ["n2", "n3"]
    assert driver.step_nodes(nodes, ["n3"], batch_host="n1", wanted=2) == ["n2", "n1"]
    assert driver.step_nodes(nodes, ["n2", "n3"], batch_host="n1", wanted=2) is None


def test_a_lost_node_restarts_the_step_on_the_spare_and_without_one_requeues() -> None:
    args = {"allocated": ["n1", "n2", "n3"], "batch_host": "n1", "wanted": 2, "budget": 3}
    assert driver.plan(0, ["n2", "n3"], None, [], relaunches=0, **args).what == "done"
    same = driver.plan(1, ["n2", "n3"], ["n1", "n2", "n3"], [], relaunches=0, **args)
    assert same.what == "end"  # no node lost: the ranks decided (failed or requeued)
    lost = driver.plan(137, ["n2", "n3"], ["n1", "n3"], [], relaunches=0, **args)
    assert lost == driver.Plan("relaunch", ("n3", "n1"), ("n2",))
    again = driver.plan(137, ["n3", "n1"], ["n1"], ["n2"], relaunches=1, **args)
    assert again == driver.Plan("requeue", ("n2", "n3"), ("n3",))  # no spare left
    spent = driver.plan(137, ["n2", "n3"], ["n1", "n3"], [], relaunches=3, **args)
    assert spent.what == "requeue" and spent.nodes == ("n2",)


def test_with_min_nodes_a_lost_node_without_a_spare_shrinks_the_step_down_to_the_minimum(
) -> None:
    args = {"allocated": ["n1", "n2", "n3", "n4"], "batch_host": "n1", "wanted": 4,
            "budget": 3, "least": 2}
    assert driver.step_nodes(args["allocated"], ["n3"], "n1", 4, least=3) == ["n2", "n4", "n1"]
    shrunk = driver.plan(137, ["n2", "n3", "n4", "n1"], ["n1", "n2", "n4"], [], relaunches=0,
                         **args)
    assert shrunk == driver.Plan("relaunch", ("n2", "n4", "n1"), ("n3",))
    again = driver.plan(137, ["n2", "n4", "n1"], ["n1", "n2"], ["n3"], relaunches=1, **args)
    assert again == driver.Plan("relaunch", ("n2", "n1"), ("n4",))
    # Below the minimum: excluded and requeued, as without the policy.
    below = driver.plan(137, ["n2", "n1"], ["n1"], ["n3", "n4"], relaunches=2, **args)
    assert below == driver.Plan("requeue", ("n3", "n4", "n2"), ("n2",))
    # Without the policy the same loss requeues at once.
    assert driver.plan(137, ["n2", "n3", "n4", "n1"], ["n1", "n2", "n4"], [], relaunches=0,
                       **{**args, "least": None}).what == "requeue"


def test_min_nodes_reaches_the_driver_and_is_checked() -> None:
    from hpc_ddp.config.compose import compose
    from hpc_ddp.errors import UserError
    from hpc_ddp.launch import slurm

    params = slurm.executor_parameters(compose(["cluster=slurm", "nodes=4",
                                                "cluster.min_nodes=3"]))
    assert params["nodes"] == 4 and "--min-nodes=3" in params["setup"][-1]
    for bad, said in (("cluster.min_nodes=5", "between 1 and nodes (4)"),
                      ("cluster.min_nodes=0", "between 1 and nodes (4)")):
        with pytest.raises(UserError, match=re.escape(said)):
            compose(["cluster=slurm", "nodes=4", bad])
    with pytest.raises(UserError, match="needs hpc_ddp's driver"):
        compose(["cluster=slurm", "nodes=4", "cluster.min_nodes=3",
                 "cluster.restarts_in_place=0"])


def test_a_failure_the_ranks_left_to_the_driver_starts_the_step_again() -> None:
    args = {"allocated": ["n1", "n2"], "batch_host": "n1", "wanted": 2, "budget": 1}
    again = driver.plan(1, ["n2", "n1"], ["n1", "n2"], [], relaunches=0, deferred=True, **args)
    assert again == driver.Plan("relaunch", ("n2", "n1"))
    assert driver.plan(1, ["n2", "n1"], ["n1", "n2"], [], relaunches=1, deferred=True,
                       **args).what == "requeue"
    # The job is no longer running (its ranks requeued it): nothing for the driver to do.
    assert driver.plan(1, ["n2", "n1"], None, [], relaunches=0, deferred=True,
                       **args).what == "end"
    seen = _events(("failure", {"job": "7", "deferred": True}))
    assert driver.deferred_failure(seen, "7")
    assert not driver.deferred_failure([*seen, {"kind": "restart_in_place", "job": "7"}], "7")
    assert not driver.deferred_failure(_events(("failure", {"job": "7"})), "7")


def test_a_supervised_slurm_job_runs_its_step_through_the_driver_with_its_spares() -> None:
    from hpc_ddp.config.compose import compose
    from hpc_ddp.launch import slurm

    params = slurm.executor_parameters(compose(["cluster=slurm", "nodes=2",
                                                "cluster.spare_nodes=1"]))
    assert params["nodes"] == 3 and params["additional_parameters"]["no_kill"] is True
    line = params["setup"][-1]
    assert line.startswith("srun() { ") and "-m hpc_ddp.slurm.driver --nodes=2" in line
    plain = slurm.executor_parameters(compose(["cluster=slurm", "nodes=2",
                                               "cluster.supervise=false"]))
    assert plain["nodes"] == 2 and "no_kill" not in plain["additional_parameters"]
    assert not any("hpc_ddp.slurm.driver" in x for x in plain["setup"])


def _self_terminating_scontrol(folder: Any) -> Any:
    """A stand-in scontrol in ``folder`` that SIGTERMs itself, then records its arguments
    (as the requeue's SIGTERM reaches a real one mid-call); the file it records to."""
    calls = folder / "calls"
    scontrol = folder / "scontrol"
    scontrol.write_text(f'#!/bin/sh\nkill -TERM $$\necho "$@" >> {calls}\n')
    scontrol.chmod(0o755)
    return calls


def test_the_exclusion_after_a_requeue_outlives_the_requeues_sigterm(tmp_path: Any,
                                                                      monkeypatch: Any) -> None:
    # The requeue SIGTERMs the whole batch step, the driver's own scontrol calls included:
    # here a stand-in scontrol that is SIGTERMed while it works (as the update was) still
    # records its call, and the driver's own handler is back afterwards.
    import os
    import signal

    calls = _self_terminating_scontrol(tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    before = signal.getsignal(signal.SIGTERM)
    assert driver.requeue_without("7", ["n2", "n3"], dict(os.environ)) is None
    assert calls.read_text().splitlines() == ["requeue 7", "update JobId=7 ExcNodeList=n2,n3"]
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_ranks_own_requeue_outlives_the_requeues_sigterm(tmp_path: Any,
                                                           monkeypatch: Any) -> None:
    # A rank's `scontrol requeue` (no container: run here, not by the relay) is SIGTERMed by
    # the requeue it asked for, before it has read the answer: a stand-in that SIGTERMs
    # itself still ends 0, and the requeue is not reported as failed ("exit code -15").
    import os

    from hpc_ddp.slurm import requeue

    calls = _self_terminating_scontrol(tmp_path)
    environ = {"PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    assert requeue.requeue("9", environ) is None
    assert calls.read_text().splitlines() == ["requeue 9"]


def _silent_rank_2(monkeypatch: pytest.MonkeyPatch, job_nodes: Any
                   ) -> tuple[g.Decision, list[float], list[int]]:
    """Rank 0's supervisor of 3 ranks after rank 1's failure, rank 2 silent (its node is
    node3): its decision, the waits it made on the store and how often it asked Slurm. A real
    store (the authenticated server and its plain client, in this process)."""
    from datetime import timedelta
    from types import SimpleNamespace

    from hpc_ddp.rank.join import authstore, store_client

    key = authstore.new_key()
    server = authstore.StoreServer(key, ["127.0.0.1"])
    store = store_client.StoreClient("127.0.0.1", server.port, key, timedelta(seconds=30),
                                     server=server)
    for r in range(3):
        store.set(f"hpc_ddp/arrived/{r}", f'{{"host": "h{r}", "node": "node{r + 1}"}}')
    asked: list[int] = []

    def nodes() -> list[str] | None:
        asked.append(1)
        return job_nodes()

    env = SimpleNamespace(rank=0, world_size=3, is_master=True, restart=0)
    rank = SimpleNamespace(env=env,
                           store=store, host="h0")
    gen = g.Generation(rank, 0, nodes)  # type: ignore[arg-type]
    waits: list[float] = []
    real = g.Generation._all_ended

    def waited(self: g.Generation, wait_s: float) -> bool:
        waits.append(round(wait_s, 2))
        return real(self, wait_s)

    monkeypatch.setattr(g.Generation, "_all_ended", waited)
    monkeypatch.setattr(g, "REPORT_WAIT_S", 1.0)
    monkeypatch.setattr(g, "NODE_CHECK_S", 0.2)
    store.set(g.key(0, "end/1"), _end(g.RESTARTABLE, 5.0, 1, "lost peer").as_json())
    store.add(g.key(0, "ended"), 1)
    store.set(g.key(0, "failed"), _end(g.RESTARTABLE, 5.0, 1, "lost peer").as_json())
    mine = _end(g.RESTARTABLE, 6.0, 0, "lost peer")
    gen.report(mine)
    decision = gen._decide(mine, 3, 60.0)
    return decision, waits, asked


def test_a_silent_rank_whose_node_left_the_job_is_lost_without_the_full_wait(
        monkeypatch: pytest.MonkeyPatch) -> None:
    decision, waits, asked = _silent_rank_2(monkeypatch, lambda: ["node1", "node2"])
    assert decision.what == g.LOST and decision.missing == (2,)
    assert waits == [0.2] and asked == [1]  # one squeue, no second wait


def test_a_silent_rank_on_a_node_the_job_still_has_gets_the_full_wait(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for answer in (["node1", "node2", "node3"], None):  # still the job's; Slurm cannot say
        decision, waits, asked = _silent_rank_2(monkeypatch, lambda a=answer: a)
        assert decision.what == g.LOST and decision.missing == (2,)
        assert waits == [0.2, 0.8] and asked == [1]
