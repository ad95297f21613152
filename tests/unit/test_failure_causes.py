"""Which failures name a peer, which are a rank's own, and which are worth a requeue."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hpc_ddp.procs import pid_alive, start_time
from hpc_ddp.rank.supervise.diagnose import (
    LOCAL_MARK,
    is_comm_failure,
    own_error,
    peer_error,
    worth_requeue,
)

GLOO_TIMEOUT = RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] "
                            "Timed out waiting 20000ms for recv operation to complete")
PEER_GONE = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection "
                         "closed by peer [10.77.0.12]:31337")
PAIR_TIMEOUT = RuntimeError("Application timeout caused pair closure")  # from DDP's backward
MISMATCH = RuntimeError("Error(s) in loading state_dict for ResNet:\n\tMissing key(s) in "
                        "state_dict: \"conv1.weight\".\n\tUnexpected key(s): \"0.weight\".")


@pytest.mark.parametrize("error, comm, requeue", [
    (GLOO_TIMEOUT, True, True),
    (PEER_GONE, True, True),
    (PAIR_TIMEOUT, True, True),
    (torch.distributed.DistBackendError("NCCL communicator was aborted"), True, True),
    (RuntimeError("CUDA error: uncorrectable ECC error encountered"), False, True),
    (OSError(5, "Input/output error"), False, True),
    (MISMATCH, False, False),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), False, False),
    (KeyError("exp_avg"), False, False),
    (ValueError("batch_size should be a positive integer"), False, False),
])
def test_classification(error: BaseException, comm: bool, requeue: bool) -> None:
    assert is_comm_failure(error) is comm
    assert worth_requeue(error) is requeue


def test_own_error_keeps_the_whole_message_within_bounds() -> None:
    text = own_error(MISMATCH)
    assert text.startswith("RuntimeError: Error(s) in loading state_dict for ResNet:")
    assert "Missing key(s)" in text and "Unexpected key(s)" in text
    long = own_error(ValueError("\n".join(f"line {i}" for i in range(50))), max_lines=3)
    assert long.splitlines() == ["ValueError: line 0", "line 1", "line 2", "..."]
    assert own_error(KeyboardInterrupt()) == "KeyboardInterrupt"


def test_peer_error_is_one_store_key_or_rank_0s_file(tmp_path: Path) -> None:
    from hpc_ddp.bench.recording import RecordingStore
    from hpc_ddp.rank.supervise.diagnose import publish_own_failure

    store = RecordingStore()
    assert peer_error(store, tmp_path) is None
    publish_own_failure(store, "rank 2 on node3: KeyError: 'exp_avg'")
    assert peer_error(store, tmp_path) == "rank 2 on node3: KeyError: 'exp_avg'"
    assert store.ops == 4  # a check each time and one get: whatever the world size
    # The store died with rank 0: its error file says whether it failed by itself.
    gone = RecordingStore(dead=True)
    (tmp_path / "rank0.error").write_text("rank 0 on node1: collective failed\n\ntrace")
    assert peer_error(gone, tmp_path) is None
    (tmp_path / "rank0.error").write_text(
        f"rank 0 on node1: {LOCAL_MARK} KeyError: 'exp_avg'\n\nTraceback ...")
    assert peer_error(gone, tmp_path) == "rank 0 on node1: KeyError: 'exp_avg'"


def test_a_reused_pid_is_not_the_process_that_was_recorded() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        started = start_time(proc.pid)
        assert started is not None
        assert pid_alive(proc.pid, started)
        assert not pid_alive(proc.pid, started + 1)  # same pid, another start: another process
    finally:
        proc.kill()
        proc.wait()
    assert start_time(proc.pid) is None and not pid_alive(proc.pid, started)
