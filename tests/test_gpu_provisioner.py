"""The provisioner chosen at the composition root, and GPU mode's wrapping of the CPU pools,
on the simulated GPU backend: no firejail, no server, no jail started (pools of size 0)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest

from appliance.core.errors import StartupError
from appliance.core.tasks import TaskScope
from appliance.gpu.provisioner import GpuProvisioner
from appliance.runtime.lifecycle import Lifecycle, provisioner_for
from appliance.runtime.metrics import Metrics
from appliance.sandbox.devices import GpuDevice
from appliance.sandbox.lease import PoolLeases
from appliance.sandbox.profiles import Profile
from appliance.sandbox.provisioner import PlainProvisioner
from appliance.settings import Settings
from appliance.wire.protocol import ExecuteRequest, GpuRequest


def gpu_settings(**kw: Any) -> Settings:
    base: dict[str, Any] = {
        "gpu": True,
        "gpu_backend": "simulated",
        "gpu_simulate_mb": (1000, 2000),
        "gpu_mps": "off",
        "pool_size": 0,  # no jail is started: the factories are never asked for one
        "preload": (),
        "python": sys.executable,
    }
    return Settings(**{**base, **kw})


class FakeCpu:
    """The CPU pools' lease source: records what it leased and whether it was closed."""

    def __init__(self) -> None:
        self.leased: list[str] = []
        self.closed = False

    @contextlib.asynccontextmanager
    async def lease(self, req: ExecuteRequest) -> AsyncIterator[str]:
        self.leased.append(req.id)
        yield "cpu-lease"

    async def close(self) -> None:
        self.closed = True


class FactoryLog:
    """Stands in for the lifecycle's jail factory maker; remembers each device it was asked for."""

    def __init__(self) -> None:
        self.devices: list[GpuDevice] = []

    def __call__(self, device: GpuDevice, profile: Profile) -> Any:
        self.devices.append(device)
        return object()  # never asked for a jail: the pools' size is 0


def test_without_gpu_mode_the_composition_root_picks_the_plain_provisioner() -> None:
    provisioner = provisioner_for(Settings(), Metrics())
    assert isinstance(provisioner, PlainProvisioner)
    assert provisioner.offload is False


def test_with_gpu_mode_the_composition_root_picks_the_gpu_provisioner_and_opens_nothing_yet() -> None:
    provisioner = provisioner_for(gpu_settings(), Metrics())
    assert isinstance(provisioner, GpuProvisioner)
    assert provisioner.offload is True
    assert provisioner.gpu is None  # the backend is opened by check_host, in startup's order
    assert provisioner.readiness(None) == ([], {})


def test_a_lifecycle_given_no_provisioner_gets_the_plain_one() -> None:
    assert isinstance(Lifecycle(Settings(), Metrics()).provisioner, PlainProvisioner)


async def test_the_plain_provisioner_leases_from_the_cpu_pools_and_closes_them() -> None:
    cpu = FakeCpu()
    provisioner = PlainProvisioner()
    provisioner.check_host(None)
    source = await provisioner.start(FactoryLog(), cast(PoolLeases, cpu), TaskScope("test"))
    assert source is cast(PoolLeases, cpu)
    assert provisioner.pool_sets() == [] and provisioner.readiness({"llama_cpp": {}}) == ([], {})
    await provisioner.close()
    assert cpu.closed


def test_the_gpu_provisioner_opens_the_backend_at_check_host_and_reports_each_layer() -> None:
    provisioner = GpuProvisioner(gpu_settings(), Metrics())
    provisioner.check_host(None)
    assert provisioner.gpu is not None
    assert set(provisioner.gpu.devices) == {"GPU-SIM-0", "GPU-SIM-1"}
    problems, fields = provisioner.readiness({"llama_cpp": {"available": True, "gpu_offload": False}})
    assert problems == []
    layers = fields["gpu"]
    assert layers["backend"] == "simulated" and layers["enforce"] == "strict"
    assert [d["total_mb"] for d in layers["devices"]] == [1000, 2000]
    # shaping is the tool probe's answer, merged in by the provisioner
    assert layers["shaping"] == {"available": True, "gpu_offload": False}


def test_the_gpu_provisioner_refuses_to_start_where_the_preloaded_tools_do_not_import() -> None:
    provisioner = GpuProvisioner(gpu_settings(preload=("llama_cpp",), python="/usr/bin/python3"), Metrics())
    with pytest.raises(StartupError, match=r"GPU mode preloads llama_cpp .* cannot import them"):
        provisioner.check_host(None)


async def test_the_gpu_provisioner_wraps_the_cpu_pools_a_run_without_a_gpu_leases_a_cpu_jail() -> None:
    provisioner = GpuProvisioner(gpu_settings(gpu_default_mb=0), Metrics())
    provisioner.check_host(None)
    cpu, factories = FakeCpu(), FactoryLog()
    async with TaskScope("test") as owner:
        source = await provisioner.start(factories, cast(PoolLeases, cpu), owner)
        assert source is provisioner.gpu
        # one pool set per device, a factory per device and profile, each for its own device
        profiles = len(provisioner.settings.preload_profiles)
        assert (
            sorted(d.uuid for d in factories.devices) == ["GPU-SIM-0"] * profiles + ["GPU-SIM-1"] * profiles
        )
        assert len(provisioner.pool_sets()) == 2
        async with source.lease(ExecuteRequest(id="plain", code="print(1)")) as lease:
            assert cast(Any, lease) == "cpu-lease"
        assert cpu.leased == ["plain"]
        # a run that asks for GPU memory holds it on the ledger, not a CPU jail
        async with source.lease(
            ExecuteRequest(id="gpu", code="print(1)", gpu=GpuRequest(memory_mb=300))
        ) as lease:
            assert lease.gpu is not None and lease.gpu.memory_mb == 300
            assert sum(int(d["reserved_mb"]) for d in provisioner.gpu.ledger.snapshot()) >= 300
        assert cpu.leased == ["plain"]
        await provisioner.close()
    assert cpu.closed


def test_the_gpu_provisioner_moves_gpu_modes_gauges() -> None:
    metrics = Metrics()
    provisioner = GpuProvisioner(gpu_settings(), metrics)
    provisioner.update_gauges()  # before check_host: nothing to read, nothing moved
    provisioner.check_host(None)
    provisioner.update_gauges()
    text = metrics.render().decode()
    assert 'appliance_gpu_mps_enforcing{device="GPU-SIM-0"} 0.0' in text
    assert 'appliance_gpu_mps_enforcing{device="GPU-SIM-1"} 0.0' in text
    assert "appliance_gpu_reclaim_timeouts 0.0" in text


def test_a_runs_gpu_budget_is_the_provisioners_its_ask_or_the_default_in_gpu_mode_none_without() -> None:
    asks, silent = ExecuteRequest(code="1", gpu=GpuRequest(memory_mb=300)), ExecuteRequest(code="1")
    gpu = GpuProvisioner(gpu_settings(gpu_default_mb=700), Metrics())
    assert (gpu.budget_mb(asks), gpu.budget_mb(silent)) == (300, 700)
    plain = PlainProvisioner()
    assert (plain.budget_mb(asks), plain.budget_mb(silent)) == (0, 0)
