"""Small parts of the fast path: the allocator switch, the NHWC gradient at a flatten, the
bare srun the startup figure compares with, the startup figure's skip without Slurm, no
compiler loaded by the deterministic switch before the rendezvous."""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hpc_ddp.bench.startup import _first_step_time, measure_startup, srun_command
from hpc_ddp.config.compose import compose
from hpc_ddp.config.schema import ModelConfig
from hpc_ddp.trainer import cpu_memory
from hpc_ddp.trainer.ddp_setup import _channels_last_gradients
from hpc_ddp.trainer.models import build_model


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_keep_freed_memory_applies_once() -> None:
    assert cpu_memory.keep_freed_memory() is True
    assert cpu_memory.keep_freed_memory() is True  # idempotent


def test_nhwc_gradient_at_flatten_changes_layout_not_values() -> None:
    grads = []
    for hooked in (False, True):
        torch.manual_seed(0)
        model = build_model(ModelConfig(name="tiny_cnn"), 16).to(
            memory_format=torch.channels_last)
        if hooked:
            _channels_last_gradients(model)
        x = torch.randn(8, 3, 16, 16).contiguous(memory_format=torch.channels_last)
        seen = []
        model[2].register_full_backward_hook(
            lambda m, gin, gout, seen=seen: seen.append(gout[0]))
        F.cross_entropy(model(x), torch.arange(8) % 10).backward()
        assert seen[0].is_contiguous(memory_format=torch.channels_last) == hooked
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_the_bare_srun_asks_for_the_same_ranks() -> None:
    cfg = compose(["cluster=slurm", "nodes=4", "cluster.tasks_per_node=2",
                   "cluster.partition=gpu", "cluster.cpus_per_task=8"])
    cmd = srun_command(cfg, "/opt/py")
    assert cmd[:6] == ["srun", "--nodes=4", "--ntasks-per-node=2", "--cpus-per-task=8",
                       f"--time={cfg.cluster.time_min}", "--job-name=hpc_ddp_bare"]
    assert "--partition=gpu" in cmd and not any(c.startswith("--account") for c in cmd)
    assert cmd[-10:] == ["/opt/py", "-m", "hpc_ddp.bench.baseline", "--model", "tiny_cnn",
                         "--steps", "1", "--warmup", "1", "--json"]
    assert _first_step_time('noise\n{"first_step_time": 12.5}\n') == 12.5
    assert _first_step_time("nothing") is None


def test_startup_is_skipped_without_slurm(tmp_path: Path) -> None:
    out = io.StringIO()
    result = measure_startup(compose(["cluster=local"]), [], tmp_path, out)
    assert "skipped" in result and "skipped" in result["line"]


def test_deterministic_kernels_load_no_compiler_before_the_rendezvous() -> None:
    """Issue 46: a rank's env: and rendezvous: lines were 4.9-13.4 s apart under load; the
    part that was ours, torch.use_deterministic_algorithms importing torch._inductor.config
    (and dynamo with it), is gone from there. The switch is the same: torch's flags, and
    inductor's own flag once inductor is imported."""
    code = textwrap.dedent("""
        import sys
        from hpc_ddp.rank.services import rng
        rng.deterministic_kernels(True)
        import torch
        assert "torch._dynamo" not in sys.modules and "torch._inductor" not in sys.modules
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
        import torch._inductor.config as inductor
        assert inductor.deterministic
        rng.deterministic_kernels(False)  # inductor loaded now: torch's own call
        assert not inductor.deterministic and not torch.are_deterministic_algorithms_enabled()
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr
