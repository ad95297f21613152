"""The nccl group: typed fields -> variables, values checked against NCCL's documented meanings."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from hpc_ddp.config.compose import compose
from hpc_ddp.config.nccl_schema import (
    FIELD_VARS,
    NcclConfig,
    nccl_warnings,
    validate_nccl,
    wanted_env,
)
from hpc_ddp.errors import UserError

Run = Callable[..., object]
PROFILES = sorted(p.stem for p in (Path(__file__).parents[2] / "conf/nccl").glob("*.yaml"))


def test_every_profile_composes_and_validates() -> None:
    assert {"default", "auto", "infiniband", "roce", "ethernet", "debug"} <= set(PROFILES)
    for name in PROFILES:
        cfg = compose([f"nccl={name}"])
        assert cfg.nccl.profile == name


# torch's flight recorder, on in every profile (docs/fault-tolerance.md#the-nccl-flight-recorder).
RECORDER = {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}


def test_default_forces_nothing_but_the_flight_recorder() -> None:
    assert wanted_env(compose([]).nccl) == RECORDER


def test_profiles_set_what_they_promise() -> None:
    ib = wanted_env(compose(["nccl=infiniband"]).nccl)
    assert ib == {"NCCL_NET_GDR_LEVEL": "PHB", "NCCL_SOCKET_IFNAME": "ib",
                  "NCCL_IB_TIMEOUT": "22", "NCCL_IB_RETRY_CNT": "7", "NCCL_CROSS_NIC": "2",
                  **RECORDER}
    assert compose(["nccl=infiniband"]).nccl.detect  # HCAs: the node's ACTIVE ports
    assert wanted_env(compose(["nccl=roce"]).nccl)["NCCL_IB_ROCE_VERSION_NUM"] == "2"
    assert wanted_env(compose(["nccl=ethernet"]).nccl) == {"NCCL_IB_DISABLE": "1", **RECORDER}
    debug = wanted_env(compose(["nccl=debug"]).nccl)
    assert debug["NCCL_DEBUG"] == "INFO" and debug["TORCH_DISTRIBUTED_DEBUG"] == "DETAIL"
    assert debug["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert int(debug["TORCH_FR_BUFFER_SIZE"]) > 0
    # The shipped profiles acknowledge what they force on purpose: no warning by default.
    for name in PROFILES:
        assert nccl_warnings(compose([f"nccl={name}"]).nccl) == [], name


def test_every_typed_field_maps_to_a_variable() -> None:
    fields = set(NcclConfig.__dataclass_fields__)
    assert set(FIELD_VARS) <= fields
    assert fields - set(FIELD_VARS) == {"profile", "detect", "acknowledged_debug", "env",
                                        "extra_env"}


@pytest.mark.parametrize("args, key, words", [
    (["nccl=infiniband", "nccl.ib_timeout=40"], "nccl.ib_timeout=40", ["1-31", "infinite"]),
    (["nccl.ib_timeout=0"], "nccl.ib_timeout=0", ["1-31", "infinite"]),
    (["nccl.ib_retry_cnt=8"], "nccl.ib_retry_cnt=8", ["0-7"]),
    (["nccl.cross_nic=3"], "nccl.cross_nic=3", ["0-2"]),
    (["nccl.gdr_level=3"], "nccl.gdr_level=3", ["legacy", "meaning changed", "PHB"]),
    (["nccl.gdr_level=NVL"], "nccl.gdr_level=NVL", ["LOC, PIX, PXB, PHB, SYS"]),
    (["nccl.ib_hca='mlx5_0:x'"], "nccl.ib_hca=mlx5_0:x", ["hca:port"]),
    (["nccl.ib_hca='=mlx5_0:0'"], "nccl.ib_hca==mlx5_0:0", ["ports count from 1"]),
    (["nccl.socket_ifname='eth0, eth1'"], "nccl.socket_ifname=eth0, eth1", ["interface name"]),
    (["nccl.socket_ifname='averyveryverylongname0'"], "nccl.socket_ifname=", ["15"]),
    (["nccl.gloo_socket_ifname='=eth0'"], "nccl.gloo_socket_ifname==eth0", ["exact"]),
    (["nccl.debug=LOUD"], "nccl.debug=LOUD", ["VERSION, WARN, INFO, TRACE"]),
    (["nccl.ib_gid_index=300"], "nccl.ib_gid_index=300", ["-1-255"]),
    (["+nccl.env.NCCL_IB_TIMEOUT=32"], "nccl.env.NCCL_IB_TIMEOUT=32", ["1-31"]),
    (["+nccl.extra_env.NCCL_NET_GDR_LEVEL=2"], "nccl.extra_env.NCCL_NET_GDR_LEVEL=2", ["legacy"]),
    # The deprecated name is checked as the variable it becomes.
    (["+nccl.env.NCCL_ASYNC_ERROR_HANDLING=9"], "nccl.env.NCCL_ASYNC_ERROR_HANDLING=9",
     ["TORCH_NCCL_ASYNC_ERROR_HANDLING", "0-3"]),
    (["nccl.ib_timeout=22", "+nccl.env.NCCL_IB_TIMEOUT=20"], "nccl.env.NCCL_IB_TIMEOUT=20",
     ["already sets it"]),
    (["nccl.acknowledged_debug=[NCCL_DEBUG]"], "nccl.acknowledged_debug=NCCL_DEBUG",
     ["debugging-only"]),
])
def test_bad_values_are_refused_naming_the_range(args: list[str], key: str,
                                                 words: list[str]) -> None:
    with pytest.raises(UserError) as caught:
        compose(args)
    message = caught.value.message
    assert message.startswith(key), message
    assert all(w in message for w in words), message
    assert "\n" not in message


def test_acceptance_exit_code_2_from_submit(hpc_ddp: Run) -> None:
    done = hpc_ddp("submit", ["nccl=infiniband", "nccl.ib_timeout=40"])
    assert done.returncode == 2  # type: ignore[attr-defined]
    err = done.stderr.strip()  # type: ignore[attr-defined]
    assert err.startswith("error: nccl.ib_timeout=40: NCCL_IB_TIMEOUT must be an integer 1-31")
    assert len(err.splitlines()) == 1 and "#nccl-ib-timeout" in err


@pytest.mark.parametrize("cfg", [
    NcclConfig(ib_hca="=mlx5_0:1,mlx5_1:1", gdr_level="PHB", ib_timeout=1, ib_retry_cnt=0,
               cross_nic=0, socket_ifname="^docker,lo", gloo_socket_ifname="eth0,eth1",
               debug="info", debug_subsys="INIT,^COLL", ib_gid_index=-1),
    NcclConfig(ib_timeout=31, ib_hca="^=mlx5_1,mlx5_4", socket_ifname="=ib0"),
    NcclConfig(env={"NCCL_ALGO": "Ring", "MY_VAR": "anything goes"}),
])
def test_good_values_pass(cfg: NcclConfig) -> None:
    validate_nccl(cfg)


def test_values_render_as_nccl_reads_them() -> None:
    cfg = NcclConfig(ib_disable=True, dump_on_timeout=False, ib_timeout=22,
                     env={"NCCL_BLOCKING_WAIT": "1", "NCCL_DEBUG": "WARN"},
                     extra_env={"NCCL_DEBUG": "INFO"})
    assert wanted_env(cfg) == {"NCCL_IB_DISABLE": "1", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
                               "NCCL_IB_TIMEOUT": "22", "TORCH_NCCL_BLOCKING_WAIT": "1",
                               "NCCL_DEBUG": "INFO"}  # extra_env wins over env


def one(warnings: list[str], *words: str) -> str:
    hits = [w for w in warnings if all(word in w for word in words)]
    assert len(hits) == 1, warnings
    return hits[0]


def test_prefix_trap_is_flagged_with_the_exact_spelling() -> None:
    text = one(nccl_warnings(NcclConfig(ib_hca="mlx5_1")), "prefix")
    assert "mlx5_10" in text and "write =mlx5_1" in text
    assert "write ^=mlx5_1" in one(nccl_warnings(NcclConfig(ib_hca="^mlx5_1")), "prefix")
    assert nccl_warnings(NcclConfig(ib_hca="=mlx5_1")) == []
    assert nccl_warnings(NcclConfig(ib_hca="mlx5")) == []  # a family prefix on purpose


def test_debug_only_settings_warn_outside_the_debug_profile() -> None:
    cfg = NcclConfig(profile="site", gdr_level="SYS", env={"NCCL_P2P_LEVEL": "NVL",
                                                           "NCCL_NVLS_ENABLE": "0"})
    warnings = nccl_warnings(cfg)
    for key in ("nccl.gdr_level=SYS", "nccl.env.NCCL_P2P_LEVEL=NVL",
                "nccl.env.NCCL_NVLS_ENABLE=0"):
        assert "Debugging" in one(warnings, key)
    assert nccl_warnings(NcclConfig(profile="debug", gdr_level="SYS")) == []
    acknowledged = NcclConfig(profile="site", gdr_level="SYS",
                              acknowledged_debug=["NCCL_NET_GDR_LEVEL"])
    assert nccl_warnings(acknowledged) == []


def test_deprecated_names_are_renamed_with_a_warning() -> None:
    cfg = NcclConfig(env={"NCCL_ASYNC_ERROR_HANDLING": "1", "NCCL_IB_GDR_LEVEL": "PHB"},
                     acknowledged_debug=["NCCL_NET_GDR_LEVEL"])
    assert wanted_env(cfg) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
                               "NCCL_NET_GDR_LEVEL": "PHB"}
    warnings = nccl_warnings(cfg)
    one(warnings, "NCCL_ASYNC_ERROR_HANDLING is deprecated", "TORCH_NCCL_ASYNC_ERROR_HANDLING")
    one(warnings, "NCCL_IB_GDR_LEVEL is deprecated", "NCCL_NET_GDR_LEVEL")


def test_other_risky_combinations() -> None:
    one(nccl_warnings(NcclConfig(debug_subsys="INIT,NETT")), "NETT")
    one(nccl_warnings(NcclConfig(ib_gid_index=3, ib_roce_version_num=2)), "ignored")
    one(nccl_warnings(NcclConfig(dump_on_timeout=True)), "records nothing")
    one(nccl_warnings(NcclConfig(torch_distributed_debug="DETAIL")), "slows")
