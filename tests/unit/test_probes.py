"""Probes: host RAM headroom, and NVML degrading per field and to "absent" (no GPU here: NVML is faked)."""

from __future__ import annotations

import types
from typing import Any

from controller.probes.gpu import GpuProbe, GpuState
from controller.probes.host import HostMemory, read_host_memory


def test_host_memory_headroom_is_available_less_the_reserve() -> None:
    mem = read_host_memory()
    assert 0 < mem.available_bytes <= mem.total_bytes
    assert HostMemory(10_000, 20_000).headroom_bytes(4_000) == 6_000
    assert HostMemory(1_000, 20_000).headroom_bytes(4_000) == 0


class NotSupported(Exception):
    pass


def fake_nvml(count: int = 2, init_error: Exception | None = None) -> Any:
    def init() -> None:
        if init_error is not None:
            raise init_error

    def memory(handle: int) -> Any:
        if handle == 1:
            raise NotSupported("memory info not supported")
        return types.SimpleNamespace(used=3 * 2**30, free=5 * 2**30, total=8 * 2**30)

    def name(handle: int) -> bytes:
        return b"Fake GPU"

    return types.SimpleNamespace(
        nvmlInit=init,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: count,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetMemoryInfo=memory,
        nvmlDeviceGetName=name,
    )


async def test_without_nvml_the_gpu_is_absent() -> None:
    reading = await GpuProbe().read()  # no NVML library on this machine
    assert reading.state is GpuState.ABSENT and reading.devices == ()
    probe = GpuProbe(fake_nvml(init_error=RuntimeError("NVML Shared Library Not Found")))
    assert (await probe.read()).state is GpuState.ABSENT and probe.absent


async def test_an_unsupported_field_is_none_and_the_rest_is_read() -> None:
    probe = GpuProbe(fake_nvml())
    reading = await probe.read()
    assert reading.state is GpuState.OK
    first, second = reading.devices
    assert (first.name, first.used_bytes, first.free_bytes) == ("Fake GPU", 3 * 2**30, 5 * 2**30)
    assert second.free_bytes is None and second.name == "Fake GPU"
    probe.close()


async def test_no_device_is_absent() -> None:
    assert (await GpuProbe(fake_nvml(count=0)).read()).state is GpuState.ABSENT
