"""GPU memory through NVML: the only module that touches pynvml (package nvidia-ml-py).

kvctl reads it only for the devices the server says it runs on, matched by PCI bus id (controller.loop.gpu_room).

Without the bindings, the driver or a GPU, the probe reports ``absent`` and nothing else changes.
A field a device does not support reads as None. NVML calls block, so they run in a thread.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from enum import StrEnum
from types import ModuleType
from typing import Any

import structlog

__all__ = ["GpuDevice", "GpuProbe", "GpuReading", "GpuState"]

log = structlog.get_logger("kvctl.probes.gpu")


class GpuState(StrEnum):
    ABSENT = "absent"
    """No bindings, no driver or no device: GPU memory plays no part."""
    OK = "ok"
    ERROR = "error"
    """NVML was there but a read failed; the previous decision inputs stay GPU-free."""


@dataclass(frozen=True, slots=True)
class GpuDevice:
    index: int
    name: str | None
    used_bytes: int | None
    free_bytes: int | None
    total_bytes: int | None
    bus_id: str | None = None
    """The PCI bus id as NVML writes it ("00000000:C1:00.0"): how a device the server reports is matched."""


@dataclass(frozen=True, slots=True)
class GpuReading:
    state: GpuState
    devices: tuple[GpuDevice, ...] = ()
    error: str | None = None


ABSENT = GpuReading(GpuState.ABSENT)


def _import_nvml() -> ModuleType | None:
    try:
        import pynvml
    except ImportError:
        return None
    module: ModuleType = pynvml
    return module


class GpuProbe:
    """Reads every device's memory; initialises NVML on first use and degrades to ``absent``."""

    def __init__(self, nvml: ModuleType | None = None) -> None:
        self._nvml = nvml if nvml is not None else _import_nvml()
        self._ready = False
        self._absent = self._nvml is None

    @property
    def absent(self) -> bool:
        return self._absent

    def _init(self) -> bool:
        nvml = self._nvml
        if self._absent or nvml is None:
            return False
        if not self._ready:
            try:
                nvml.nvmlInit()
            except Exception as e:  # NVMLError_LibraryNotFound, _DriverNotLoaded, _NoPermission, ...
                log.info("gpu.absent", reason=str(e) or type(e).__name__)
                self._absent = True
                return False
            self._ready = True
        return True

    def _field(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception:  # NVMLError_NotSupported and friends: this field is unknown, the others are not
            return None

    def read_sync(self) -> GpuReading:
        if not self._init():
            return ABSENT
        nvml = self._nvml
        assert nvml is not None
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except Exception as e:
            return GpuReading(GpuState.ERROR, error=str(e) or type(e).__name__)
        if count == 0:
            return ABSENT
        devices = []
        for i in range(count):
            handle = self._field(nvml.nvmlDeviceGetHandleByIndex, i)
            if handle is None:
                devices.append(GpuDevice(i, None, None, None, None))
                continue
            mem = self._field(nvml.nvmlDeviceGetMemoryInfo, handle)
            name = self._field(nvml.nvmlDeviceGetName, handle)
            if isinstance(name, bytes):
                name = name.decode()
            pci_info = getattr(nvml, "nvmlDeviceGetPciInfo", None)
            pci = self._field(pci_info, handle) if pci_info is not None else None
            bus_id = getattr(pci, "busId", None) if pci is not None else None
            if isinstance(bus_id, bytes):
                bus_id = bus_id.decode()
            devices.append(
                GpuDevice(
                    index=i,
                    name=name,
                    used_bytes=int(mem.used) if mem is not None else None,
                    free_bytes=int(mem.free) if mem is not None else None,
                    total_bytes=int(mem.total) if mem is not None else None,
                    bus_id=bus_id,
                )
            )
        return GpuReading(GpuState.OK, tuple(devices))

    async def read(self) -> GpuReading:
        if self._absent:
            return ABSENT
        return await asyncio.to_thread(self.read_sync)

    def close(self) -> None:
        if self._ready and self._nvml is not None:
            self._field(self._nvml.nvmlShutdown)
            self._ready = False
