"""Staging a data set once per node (hpc_ddp/data/staging.py, stage_node.py): the copy, the
manifest's reuse and re-stage, the space check, and the node barrier between real processes
on a real TCPStore (the Slurm proof is tests/cluster/test_staging.py)."""

from __future__ import annotations

import json
import multiprocessing
import os
import tarfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from hpc_ddp.data import stage_node, staging
from hpc_ddp.errors import UserError
from hpc_ddp.rank.join.distenv import DistEnv

MINE = f"hpc_ddp-stage-{os.geteuid()}"  # this user's folder under a stage_dir
OTHER_UID = 4242  # a second user, made with chown (the tests run as root)


def alone(node: int = 0) -> DistEnv:
    return DistEnv(rank=0, local_rank=0, world_size=1, node_rank=node, num_nodes=1,
                   local_world_size=1, source="single", job_id="t")


@pytest.fixture(autouse=True)
def released() -> Any:
    yield
    stage_node.release()  # the copies this test process used (a process ending does this)


def folder(root: Path, files: int = 5) -> Path:
    for i in range(files):
        (root / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        (root / f"c{i % 2}" / f"{i}.bin").write_bytes(bytes([i]) * (100 + i))
    return root


def stage(src: Path, stage_dir: Path, host: str = "nodeA") -> staging.Staged:
    return stage_node.stage(str(src), str(stage_dir), alone(), host, None, {})


def test_a_folder_is_copied_once_then_reused_and_a_change_restages(tmp_path: Path) -> None:
    src = folder(tmp_path / "src")
    first = stage(src, tmp_path / "stage")
    assert first.by_me and not first.reused and first.files == 5
    assert sorted(p.name for p in first.root.rglob("*.bin")) == [f"{i}.bin" for i in range(5)]
    assert (first.root / "c1" / "3.bin").read_bytes() == bytes([3]) * 103
    assert first.root.is_relative_to(tmp_path / "stage" / MINE / "nodeA")
    again = stage(src, tmp_path / "stage")
    assert again.reused and not again.by_me and again.root == first.root
    stage_node.release()  # that job ended
    (src / "c0" / "new.bin").write_bytes(b"x")
    changed = stage(src, tmp_path / "stage")
    assert changed.by_me and changed.files == 6 and changed.root != first.root
    assert not first.root.exists()  # the old version, held by nobody, made room


def test_a_copy_in_use_by_another_job_is_not_removed(tmp_path: Path) -> None:
    src = folder(tmp_path / "src")
    first = stage(src, tmp_path / "stage")  # still held: this process "is" the other job
    (src / "c0" / "new.bin").write_bytes(b"x")
    stage(src, tmp_path / "stage")
    assert first.root.is_dir()


def test_a_damaged_copy_is_not_reused(tmp_path: Path) -> None:
    src = folder(tmp_path / "src")
    first = stage(src, tmp_path / "stage")
    (first.root / "c0" / "0.bin").unlink()  # a tmp cleaner took a file
    stage_node.release()
    assert stage(src, tmp_path / "stage").by_me


def _chown_tree(top: Path, uid: int) -> None:
    for folder_, dirs, files in os.walk(top):
        for name in [*dirs, *files]:
            os.lchown(Path(folder_) / name, uid, uid)
    os.lchown(top, uid, uid)


@pytest.mark.skipif(os.geteuid() != 0, reason="making a second user's files needs root")
@pytest.mark.parametrize("planted", ["top", "node", "copy"])
def test_a_copy_planted_by_another_user_is_refused_and_never_read(tmp_path: Path,
                                                                  planted: str) -> None:
    """Another user makes the stage folder first (its whole tree, or one folder of it) with a
    "copy" whose fingerprint, file count and checksums all match the source but whose data is
    theirs: refused in one line naming the folder, the planted bytes never returned."""
    src = folder(tmp_path / "src")
    made = stage(src, tmp_path / "other")  # a genuine copy, moved into place as theirs
    stage_node.release()
    payload = bytes([0xEE]) * 100  # same size as 0.bin: only a checksum could tell
    (made.root / "c0" / "0.bin").write_bytes(payload)
    manifest = next((tmp_path / "other").rglob("manifest.json"))
    record = json.loads(manifest.read_text())
    record["checksums"] = staging.checksums(manifest.parent / "data")
    manifest.write_text(json.dumps(record))
    os.rename(tmp_path / "other", tmp_path / "stage")
    top = tmp_path / "stage" / MINE
    key = made.root.relative_to(tmp_path / "other" / MINE / "nodeA").parts[0]
    victim = {"top": top, "node": top / "nodeA", "copy": top / "nodeA" / key}[planted]
    _chown_tree(victim, OTHER_UID)
    with pytest.raises(UserError) as raised:
        stage(src, tmp_path / "stage")
    message = raised.value.message
    assert f"{victim} on node nodeA belongs to uid {OTHER_UID}, not to you" in message
    assert f"Fix: remove {victim}" in message and "\n" not in message
    planted_file = next((top / "nodeA" / key).rglob("0.bin"))
    assert planted_file.read_bytes() == payload  # untouched, unread


def test_a_copy_changed_after_it_was_staged_is_staged_again(tmp_path: Path) -> None:
    """Same size, same count, same fingerprint; only the checksum tells."""
    src = folder(tmp_path / "src")
    first = stage(src, tmp_path / "stage")
    (first.root / "c1" / "3.bin").write_bytes(bytes([0xEE]) * 103)
    stage_node.release()
    again = stage(src, tmp_path / "stage")
    assert again.by_me and not again.reused
    assert (again.root / "c1" / "3.bin").read_bytes() == bytes([3]) * 103


def test_a_stage_folder_others_can_write_is_refused(tmp_path: Path) -> None:
    (tmp_path / "stage" / MINE).mkdir(parents=True)
    (tmp_path / "stage" / MINE).chmod(0o777)
    with pytest.raises(UserError) as raised:
        stage(folder(tmp_path / "src"), tmp_path / "stage")
    assert "can be written by others (mode 0777)" in raised.value.message


def test_nodes_have_their_own_copies_in_one_stage_dir(tmp_path: Path) -> None:
    src = folder(tmp_path / "src")
    a, b = stage(src, tmp_path / "stage", "nodeA"), stage(src, tmp_path / "stage", "nodeB")
    assert a.by_me and b.by_me and a.root != b.root


def test_a_tar_is_extracted_and_its_one_folder_is_the_root(tmp_path: Path) -> None:
    src = folder(tmp_path / "imagenet")
    archive = tmp_path / "imagenet.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(src, arcname="imagenet")
    staged = stage(archive, tmp_path / "stage")
    assert staged.root.name == "imagenet" and staged.files == 5
    assert (staged.root / "c0" / "0.bin").read_bytes() == bytes([0]) * 100
    stage_node.release()
    assert stage(archive, tmp_path / "stage").reused
    os.utime(archive, ns=(1, 1))  # a new tar
    stage_node.release()
    assert stage(archive, tmp_path / "stage").by_me


def test_fingerprint_of_a_big_folder_sees_names_not_sizes(tmp_path: Path) -> None:
    src = folder(tmp_path / "src")
    source = staging.source_of(str(src))
    small, big = staging.fingerprint(source), staging.fingerprint(source, stat_files_up_to=0)
    (src / "c0" / "0.bin").write_bytes(b"rewritten in place, longer than before")
    assert staging.fingerprint(source) != small  # sizes and mtimes are in a small one
    assert staging.fingerprint(source, stat_files_up_to=0) == big  # the documented blind spot
    (src / "c0" / "extra.bin").write_bytes(b"")
    assert staging.fingerprint(source, stat_files_up_to=0) != big


def test_a_node_without_the_space_fails_at_once_naming_it(tmp_path: Path) -> None:
    archive = tmp_path / "huge.tar"
    needed = staging.shutil.disk_usage(tmp_path).free + 2**30
    with open(archive, "wb") as handle:  # sparse: more than the disk holds, taking nothing
        handle.truncate(needed)
    with pytest.raises(staging.StageSpaceError) as info:
        stage(archive, tmp_path / "stage", "node7")
    message = info.value.message
    assert "node node7" in message and f"{needed} bytes needed" in message
    assert "free" in message and "Fix:" in message and "\n" not in message
    home = tmp_path / "stage" / f"hpc_ddp-stage-{os.geteuid()}" / "node7"
    assert not [p for p in home.rglob("*") if p.is_dir() and p.name.endswith(".partial")]


@pytest.mark.parametrize("root, said", [("/nonexistent/data", "does not exist"),
                                        (__file__, "not a tar archive")])
def test_nothing_to_stage_is_named(root: str, said: str) -> None:
    with pytest.raises(UserError) as info:
        staging.source_of(root)
    assert info.value.message.startswith(f"data.root={root}") and said in info.value.message


def test_default_stage_dir_follows_slurm_then_tmpdir() -> None:
    assert staging.default_stage_dir({"SLURM_TMPDIR": "/l/job", "TMPDIR": "/t"}) == "/l/job"
    assert staging.default_stage_dir({"TMPDIR": "/t"}) == "/t"
    assert staging.default_stage_dir({}) == "/tmp"


# -- the node barrier between processes --------------------------------------------------
NODES, PER_NODE = 2, 2


def _rank(rank: int, port: int, src: str, stage_dir: str, queue: Any, group: bool) -> None:
    import torch.distributed as dist

    world = NODES * PER_NODE
    store = dist.TCPStore("127.0.0.1", port, world, False, timedelta(seconds=60))
    env = DistEnv(rank=rank, local_rank=rank % PER_NODE, world_size=world,
                  node_rank=rank // PER_NODE, num_nodes=NODES, local_world_size=PER_NODE,
                  source="local", job_id="t", nodes=("nodeA", "nodeB"))
    if group:
        dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank,
                                world_size=world)
    try:
        staged = stage_node.stage(src, stage_dir, env, env.nodes[env.node_rank], store, {})
        queue.put((rank, str(staged.root), staged.by_me, None))
    except UserError as exc:
        queue.put((rank, None, False, exc.message))
    finally:
        if group:
            dist.destroy_process_group()


def _run_ranks(src: Path, stage_dir: Path, group: bool) -> dict[int, tuple[Any, bool, Any]]:
    ctx = multiprocessing.get_context("fork")
    # The store's server in a process of its own (rank 0's, in a job), up before any rank
    # connects (a client that comes first waits seconds in TCPStore's retry).
    ports, stop = ctx.Queue(), ctx.Event()
    server = ctx.Process(target=_serve, args=(ports, stop))
    server.start()
    port = ports.get(timeout=30)
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, str(src), str(stage_dir), queue, group))
             for r in range(NODES * PER_NODE)]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        rank, root, by_me, error = queue.get(timeout=60)
        results[rank] = (root, by_me, error)
    for p in procs:
        p.join(timeout=30)
    stop.set()
    server.join(timeout=30)
    return results


def _serve(ports: Any, stop: Any) -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=60),
                          wait_for_workers=False)
    ports.put(store.port)
    stop.wait(120)


def test_each_node_stages_once_and_its_ranks_share_the_copy(tmp_path: Path) -> None:
    src = folder(tmp_path / "src", files=40)
    results = _run_ranks(src, tmp_path / "stage", group=False)
    for node in range(NODES):
        ranks = range(node * PER_NODE, (node + 1) * PER_NODE)
        assert sum(results[r][1] for r in ranks) == 1  # exactly one copy made per node
        assert len({results[r][0] for r in ranks}) == 1  # one copy shared by the node
        assert results[node * PER_NODE][1]  # by its local rank 0
    assert results[0][0] != results[PER_NODE][0]


def test_a_failing_node_fails_every_rank_with_its_message(tmp_path: Path) -> None:
    src = folder(tmp_path / "src")
    (tmp_path / "stage" / f"hpc_ddp-stage-{os.geteuid()}").mkdir(parents=True)
    (tmp_path / "stage" / f"hpc_ddp-stage-{os.geteuid()}" / "nodeB").write_text("not a folder")
    results = _run_ranks(src, tmp_path / "stage", group=True)
    for rank, (_, _, error) in results.items():
        assert error is not None, rank
        assert "nodeB on node nodeB is not a folder: no copy can be kept there" in error, error


class _Alone:
    """What stage_data needs of a joined rank, for one process without a store."""

    env = alone()
    host = "nodeA"
    store = None


def test_a_target_factory_is_given_the_copy_as_its_root(tmp_path: Path) -> None:
    from hpc_ddp.config.compose import compose
    from hpc_ddp.data.sets import build_datasets
    from hpc_ddp.data.stage_run import stage_data
    from hpc_ddp.rundir import RunDir

    src = folder(tmp_path / "src", files=6)
    cfg = compose(["data._target_=tests.usercode.parts.files_under", f"+data.root={src}",
                   "data.stage=true", f"data.stage_dir={tmp_path / 'stage'}"])
    staged_cfg, summary = stage_data(cfg, _Alone(), RunDir(tmp_path / "run"), {})
    root = Path(staged_cfg.data.kwargs["root"])
    assert root.is_relative_to(tmp_path / "stage") and summary is not None
    assert summary["nodes_staged"] == 1 and summary["files"] == 6 and summary["root"] == str(root)
    assert len(build_datasets(staged_cfg.data, 0).train) == 6  # read from the copy
    assert stage_data(compose([]), _Alone(), RunDir(tmp_path), {}) == (compose([]), None)


def test_rank_0_progress_reaches_the_console_of_wait(tmp_path: Path) -> None:
    import io
    import json
    import time

    from hpc_ddp.watch.follow import _Reporter

    out = io.StringIO()
    reporter = _Reporter(out, since=time.time() - 1)
    progress = {"step": 0, "time": time.time(),
                "stage": {"done": 3 * 2**29, "total": 2**31, "rate": 2.1e8, "host": "node1"}}
    reporter.update(json.loads(json.dumps(progress)))
    reporter.update(progress)  # the same figures are not said twice
    assert out.getvalue() == "staging data on node1: 1.50 of 2.00 GiB (75%), 210 MB/s\n"


def test_submit_checks_a_tar_root_and_a_shards_index(tmp_path: Path) -> None:
    from hpc_ddp.config.compose import compose
    from hpc_ddp.launch.check_code import check_parts

    archive = tmp_path / "images.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(folder(tmp_path / "images"), arcname="images")
    check_parts(compose(["data=image_folder", f"data.root={archive}", "data.stage=true"]))
    with pytest.raises(UserError, match="add data.stage=true"):
        check_parts(compose(["data=image_folder", f"data.root={archive}"]))
    with pytest.raises(UserError, match="python -m hpc_ddp.data pack"):
        check_parts(compose(["data=shards", f"data.root={tmp_path}"]))


def test_stage_dir_variables_are_the_nodes_own(tmp_path: Path) -> None:
    src = folder(tmp_path / "src")
    env = {"LOCAL": str(tmp_path / "local")}
    staged = stage_node.stage(str(src), "${LOCAL}/s", alone(), "nodeA", None, env)
    assert staged.root.is_relative_to(tmp_path / "local" / "s")
    with pytest.raises(UserError, match=r"names \$SLURM_TMPDIR, which is not set on node nodeA"):
        stage_node.stage(str(src), "$SLURM_TMPDIR/s", alone(), "nodeA", None, {})


def test_a_folder_of_one_folder_stays_itself(tmp_path: Path) -> None:
    (tmp_path / "src" / "train").mkdir(parents=True)  # a tar's one folder is its root; not so
    (tmp_path / "src" / "train" / "x.bin").write_bytes(b"x")  # for a folder
    assert (stage(tmp_path / "src", tmp_path / "stage").root / "train" / "x.bin").is_file()
