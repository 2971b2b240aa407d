"""GPU inputs: what other processes take of the GPUs the server runs on, since the server became ready.

llama-server allocates its weights, KV pool and compute buffers when it loads, so on a normally loaded GPU the free
memory is small all the time, and it says nothing about the server's room. What can hurt it is another process
taking memory after it was ready: a compute buffer the server reallocates (a larger batch) may then not fit. So the
policy holds restores and admissions back only while, on a device the server uses (the server names them in
``/kv``, patch 22), memory taken by others has grown since the server's start and left less than
``policy.gpu_headroom_mib`` free. NVML, where kvctl sees it, only refines the numbers of those same devices, matched
by PCI bus id (never by PID: in a container kvctl does not see the server's). A server that names no device (a CPU
build, or one without patch 22) never holds anything back for GPU memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from controller.probes.gpu import GpuReading, GpuState
from controller.upstream.models import KvSnapshot

__all__ = ["DeviceRoom", "GpuBaseline", "GpuRoom", "normalize_bus_id"]

MiB = 1024 * 1024
GROWTH_NOISE_BYTES = 1024 * MiB
"""Growth of "others" below this does not count. The server's own buffers as it reports them (weights, KV, compute) are
not all it takes: the CUDA backend's memory pool, cuBLAS workspaces and CUDA graphs grow lazily with the first large
batches and never shrink, and they show up as "others". 1 GiB is a guess made without a GPU to measure on (no device
was lent): bench/gpu.sh should measure how much they grow, and this be set from it."""


def normalize_bus_id(bus_id: str | bytes | None) -> str | None:
    """ "00000000:C1:00.0" (NVML) and "0000:c1:00.0" (ggml) are the same device: domain as 4 hex digits, lower case."""
    if bus_id is None:
        return None
    text = bus_id.decode() if isinstance(bus_id, bytes) else bus_id
    parts = text.strip().lower().split(":")
    if len(parts) != 3:
        return text.strip().lower() or None
    try:
        domain = int(parts[0], 16)
    except ValueError:
        return None
    return f"{domain:04x}:{parts[1]}:{parts[2]}"


@dataclass(frozen=True, slots=True)
class DeviceRoom:
    name: str
    device_id: str | None
    total_bytes: int
    used_bytes: int
    free_bytes: int
    server_bytes: int
    """The server's own buffers on it, as the server reports them."""
    others_bytes: int
    """Used by anything else: other processes, and the driver's own share."""
    others_growth_bytes: int
    """How much others' use grew since the server became ready (this boot of it)."""
    source: str
    """``nvml`` where NVML sees the device (matched by bus id), else ``server`` (its backend's numbers)."""


@dataclass(frozen=True, slots=True)
class GpuRoom:
    devices: tuple[DeviceRoom, ...] = ()
    held: str | None = None
    """Why restores and admissions wait for GPU memory, in words; None when they do not."""
    free_bytes: int | None = None
    """The tightest free memory among the devices that hold things back (the policy's input), else None."""


NO_GPU = GpuRoom()


class GpuBaseline:
    """Others' memory on each of the server's devices at the first poll of a boot of the server."""

    def __init__(self) -> None:
        self._boot: str | None = None
        self._base: dict[str, int] = {}

    def room(self, kv: KvSnapshot, nvml: GpuReading | None, headroom_bytes: int) -> GpuRoom:
        if not kv.devices:
            return NO_GPU
        boot = kv.server.boot_id if kv.server is not None else None
        if boot != self._boot:
            self._boot, self._base = boot, {}
        by_bus = {}
        if nvml is not None and nvml.state is GpuState.OK:
            by_bus = {key: d for d in nvml.devices if (key := normalize_bus_id(d.bus_id)) is not None}
        rooms = []
        for d in kv.devices:
            key = normalize_bus_id(d.device_id) or d.name
            bus = normalize_bus_id(d.device_id)
            nv = by_bus.get(bus) if bus is not None else None
            # NVML sees the whole GPU: where the server's device is a part of it (a MIG slice), the backend's own
            # numbers are the ones that describe the server's room
            whole = nv is not None and nv.total_bytes is not None and nv.total_bytes <= d.memory_total_bytes * 1.05
            if nv is not None and whole and nv.used_bytes is not None and nv.free_bytes is not None and nv.total_bytes:
                total, used, free, source = nv.total_bytes, nv.used_bytes, nv.free_bytes, "nvml"
            else:
                total, free, source = d.memory_total_bytes, d.memory_free_bytes, "server"
                used = max(0, total - free)
            others = max(0, used - d.buffers_bytes)
            base = self._base.setdefault(key, others)
            growth = others - base
            rooms.append(DeviceRoom(d.name, d.device_id, total, used, free, d.buffers_bytes, others, growth, source))
        tight = [r for r in rooms if r.others_growth_bytes >= GROWTH_NOISE_BYTES and r.free_bytes < headroom_bytes]
        if not tight:
            return GpuRoom(tuple(rooms))
        worst = min(tight, key=lambda r: r.free_bytes)
        held = (
            f"{worst.name}: other processes took {worst.others_growth_bytes // MiB} MiB since the server started, "
            f"{worst.free_bytes // MiB} MiB free is under policy.gpu_headroom_mib ({headroom_bytes // MiB})"
        )
        return GpuRoom(tuple(rooms), held, worst.free_bytes)
