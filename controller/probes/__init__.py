"""What the host can give: available RAM (psutil) and GPU memory (NVML, optional)."""

from controller.probes.gpu import GpuDevice, GpuProbe, GpuReading
from controller.probes.host import HostMemory, read_host_memory

__all__ = ["GpuDevice", "GpuProbe", "GpuReading", "HostMemory", "read_host_memory"]
