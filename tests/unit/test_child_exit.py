"""A supervised training process that fails while joining (rank/main/child.py): the network's
failure is one its supervisors restart in place past; any other is final."""

from __future__ import annotations

from hpc_ddp.errors import UserError
from hpc_ddp.rank.contract import RESTART_EXIT_CODE
from hpc_ddp.rank.main.child import exit_code


def test_gloos_full_mesh_closed_by_a_peer_is_restarted_in_place() -> None:
    # What CI saw in the first job of a freshly started test cluster: one attempt's bad luck.
    gloo = RuntimeError("Gloo connectFullMesh failed with [/__w/pytorch/pytorch/third_party/"
                        "gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer "
                        "[10.77.0.14]:692. This is typically caused by a remote worker crashing.")
    assert exit_code(gloo) == RESTART_EXIT_CODE
    assert exit_code(ConnectionResetError("Connection reset by peer")) == RESTART_EXIT_CODE


def test_anything_else_while_joining_is_final() -> None:
    assert exit_code(ValueError("cluster.tasks_per_node=3 but SLURM_NTASKS_PER_NODE=2")) == 1
    # A refused setting whose message names Gloo is the user's to fix, not the network's.
    assert exit_code(UserError("nccl.socket_ifname", "eth9", "no such interface for gloo",
                               "use one of: eth0")) == 1
