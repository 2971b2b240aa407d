"""Host memory from psutil: what a park may still copy into RAM."""

from __future__ import annotations

from dataclasses import dataclass

import psutil

__all__ = ["HostMemory", "read_host_memory"]


@dataclass(frozen=True, slots=True)
class HostMemory:
    available_bytes: int
    """Memory the kernel can hand out without swapping (MemAvailable)."""
    total_bytes: int

    def headroom_bytes(self, reserve_bytes: int) -> int:
        """What snapshots may still take: available memory less a reserve kept for everything else."""
        return max(0, self.available_bytes - reserve_bytes)


def read_host_memory() -> HostMemory:
    vm = psutil.virtual_memory()
    return HostMemory(available_bytes=int(vm.available), total_bytes=int(vm.total))
