"""GPU inputs that mean something (issue 18): only the devices the server runs on, and only what other processes take
of them after the server started, hold restores and admissions back.

A fake pynvml (in place of nvidia-ml-py) and the scripted fake server, which reports its devices in /kv as patch 22
does. That the real CPU server reports none is tested by the series (tools/server/tests/unit/test_kv_identity.py).
"""

from __future__ import annotations

import types
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from controller.admin.models import Status
from controller.admin.status import build_status
from controller.loop.control import ControlLoop
from controller.loop.gpu_room import normalize_bus_id
from controller.metrics import Metrics
from controller.probes.gpu import GpuProbe
from controller.settings import deprecations, load_settings
from controller.upstream.client import UpstreamClient
from tests.fakes.llama_server import FakeLlamaServer, kv_body
from tests.harness import LOOP_NOW as NOW
from tests.harness import loop_settings as settings
from tests.harness import plenty

GiB = 1024**3
MiB = 1024**2


class FakeNvml:
    """pynvml's calls kvctl makes, over devices whose used memory a test changes."""

    def __init__(self, devices: list[dict[str, Any]]) -> None:
        self.devices = devices

    def module(self) -> Any:
        def memory(h: int) -> Any:
            d = self.devices[h]
            return types.SimpleNamespace(total=d["total"], used=d["used"], free=d["total"] - d["used"])

        return types.SimpleNamespace(
            nvmlInit=lambda: None,
            nvmlShutdown=lambda: None,
            nvmlDeviceGetCount=lambda: len(self.devices),
            nvmlDeviceGetHandleByIndex=lambda i: i,
            nvmlDeviceGetMemoryInfo=memory,
            nvmlDeviceGetName=lambda h: self.devices[h]["name"].encode(),
            nvmlDeviceGetPciInfo=lambda h: types.SimpleNamespace(busId=self.devices[h]["bus"].encode()),
        )


def two_gpus() -> FakeNvml:
    # GPU 0 99.9 % used from the start (the server, or anyone), GPU 1 idle
    return FakeNvml(
        [
            {"name": "H200", "bus": "00000000:01:00.0", "total": 140 * GiB, "used": int(140 * GiB * 0.999)},
            {"name": "H200", "bus": "00000000:02:00.0", "total": 140 * GiB, "used": 0},
        ]
    )


def a_restore_waiting(**extra: Any) -> dict[str, Any]:
    # 300 of 1000 cells resident, one request parked: with this much room it is restored at once
    park = {"count": 1, "bytes": 100 * 512, "t_parked_total_ms": 0, "parked_since_ms": NOW - 1000}
    slots = [
        {"state": "generating", "n_cells": 300, "id_task": 1, "t_arrival_ms": 1},
        {"state": "parked", "n_cells": 100, "id_task": 2, "t_arrival_ms": 2, "park": park},
        {"state": "idle"},  # room for one more request
    ]
    return kv_body(1000, slots, **{"server": {"boot_id": "a" * 16, "t_start_ms": NOW - 60_000}, **extra})


def server_device(free: int, buffers: int = 130 * GiB, total: int = 140 * GiB) -> dict[str, Any]:
    return {
        "name": "CUDA0",
        "description": "NVIDIA H200",
        "device_id": "0000:01:00.0",
        "memory_free_bytes": free,
        "memory_total_bytes": total,
        "buffers_bytes": buffers,
    }


def make_loop(client: UpstreamClient, nvml: FakeNvml | None) -> ControlLoop:
    probe = GpuProbe(nvml.module()) if nvml is not None else GpuProbe(types.SimpleNamespace())
    if nvml is None:
        probe._absent = True  # no bindings: what a host without nvidia-ml-py gives
    loop = ControlLoop(client, settings(), Metrics(CollectorRegistry()), gpu=probe, host=plenty, clock_ms=lambda: NOW)
    loop._gpu_read_at = -1e9
    return loop


def status_of(loop: ControlLoop) -> Status:
    return build_status(
        version="t",
        url="u",
        state=loop.state,
        config=loop.config,
        loop_alive=True,
        ready=True,
        degraded=False,
        problems=[],
        supervisor=None,
        uptime_s=1,
    )


def resumed(fake: FakeLlamaServer) -> list[str]:
    return [s.path for s in fake.seen if s.query.get("action") == "resume"]


async def test_gpus_the_server_does_not_use_change_nothing(fake: FakeLlamaServer, client: UpstreamClient) -> None:
    outcomes = []
    for nvml in (two_gpus(), None):
        fake.seen.clear()
        fake.kv = a_restore_waiting(devices=[])  # the CPU build: it runs on no device
        loop = make_loop(client, nvml)
        assert await loop.step()
        admission = loop.admission(50)
        status = status_of(loop)
        outcomes.append((resumed(fake), admission, status.gpu, status.gpu_devices, status.gpu_held))
    assert outcomes[0] == outcomes[1], "with a 99.9 % used GPU in the host, as without NVML at all"
    assert outcomes[0][0] == ["/slots/1"] and outcomes[0][1] is not None  # the same admission verdict too
    assert outcomes[0][2] == "absent"


@pytest.mark.parametrize("with_nvml", [True, False], ids=["nvml", "server-backend-only"])
async def test_memory_others_take_after_the_server_started_holds_restores(
    fake: FakeLlamaServer, client: UpstreamClient, with_nvml: bool
) -> None:
    nvml = two_gpus() if with_nvml else None

    async def poll(free: int, boot: str) -> list[str]:
        """One poll with `free` bytes free on the server's GPU (its own buffers 130 GiB of 140): the resumes asked."""
        fake.kv = a_restore_waiting(devices=[server_device(free=free)], server={"boot_id": boot, "t_start_ms": NOW})
        if nvml is not None:
            nvml.devices[0]["used"] = 140 * GiB - free
        fake.seen.clear()
        loop._gpu_read_at = -1e9
        assert await loop.step()
        return resumed(fake)

    loop = make_loop(client, nvml)
    # loaded: 100 MiB free, under the 256 MiB headroom, all of it the server's own doing
    assert await poll(100 * MiB, "a" * 16) == ["/slots/1"], "the server's own full GPU never holds a restore back"
    assert loop.state.gpu_room.held is None
    # another start of the server leaves 3 GiB free; then another process takes 2.9 GiB of it
    assert await poll(3 * GiB, "b" * 16) == ["/slots/1"]
    assert await poll(100 * MiB, "b" * 16) == [], "others took memory since it started, little is free: restores wait"
    held = loop.state.gpu_room.held
    assert held is not None and "CUDA0" in held and "since the server started" in held
    admission = loop.admission(50)
    assert admission is not None and not admission.admit
    status = status_of(loop)
    assert status.gpu == "ok" and status.gpu_held == held
    (dev,) = status.gpu_devices
    assert dev.source == ("nvml" if with_nvml else "server")
    assert dev.server_bytes == 130 * GiB and dev.others_growth_bytes == 3 * GiB - 100 * MiB
    assert loop.metrics.registry.get_sample_value("kvctl_gpu_memory_others_bytes", {"gpu": "CUDA0"}) == dev.others_bytes
    # the other process goes away: restores go on
    assert await poll(3 * GiB, "b" * 16) == ["/slots/1"] and loop.state.gpu_room.held is None
    # a restarted server (new boot id) starts a new baseline: what others hold then is the new normal
    assert await poll(100 * MiB, "c" * 16) == ["/slots/1"] and loop.state.gpu_room.held is None


def test_nvml_and_ggml_bus_ids_name_the_same_device() -> None:
    assert normalize_bus_id("00000000:C1:00.0") == normalize_bus_id("0000:c1:00.0") == "0000:c1:00.0"
    assert normalize_bus_id(b"00000000:01:00.0") == "0000:01:00.0"
    assert normalize_bus_id(None) is None


def test_a_renamed_setting_is_accepted_with_a_warning_naming_its_replacement(monkeypatch: pytest.MonkeyPatch) -> None:
    s = load_settings(overrides={"policy": {"gpu_free_floor_mib": 100}})
    assert s.policy.gpu_headroom_mib == 100
    (message,) = deprecations()
    assert "policy.gpu_free_floor_mib" in message and "policy.gpu_headroom_mib" in message
    monkeypatch.setenv("KVCTL_POLICY__GPU_FREE_FLOOR_MIB", "64")
    assert load_settings().policy.gpu_headroom_mib == 64
    assert "KVCTL_POLICY__GPU_HEADROOM_MIB" in deprecations()[0]
    s = load_settings(overrides={"policy": {"gpu_headroom_mib": 32}})
    assert s.policy.gpu_headroom_mib == 32 and "wins" in deprecations()[0], "both set: the new name wins"
    monkeypatch.delenv("KVCTL_POLICY__GPU_FREE_FLOOR_MIB")
    assert load_settings().policy.gpu_headroom_mib == 256 and deprecations() == ()
