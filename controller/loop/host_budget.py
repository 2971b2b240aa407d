"""Host memory adds up: the server's fixed buffers and its growing budgets against what the host has.

llama-server takes host memory four ways besides its model and KV buffers: snapshots of parks by swap
(--park-ram), the idle slots' prompt cache (--cache-ram, 8192 MiB by default), context checkpoints (iSWA
and hybrid models: up to --ctx-checkpoints a slot) and kvctl's own few hundred MiB. Each budget is sized
alone; together they may exceed the host or the container, and the kernel's OOM killer then picks the
largest process: the server, every request with it. kvctl adds them up from the server's ``/kv``
``host_memory`` (patch 39) and warns once per server start when what can still grow exceeds what is
available.
"""

from __future__ import annotations

from dataclasses import dataclass

from controller.upstream.models import KvSnapshot

PARTS = ("model", "context", "park_ram", "cache_ram", "checkpoints")
"""The parts of kvctl_host_memory_bytes: fixed (model, context) and growing (the three budgets)."""


@dataclass(frozen=True, slots=True)
class HostBudget:
    parts: dict[str, int]
    """Each part's bound: the fixed buffers as they are, each budget at its limit (what it holds when unbounded)."""
    growth: int
    """What the budgets may still take beyond what they hold now."""
    available: int | None
    """What the host (or the container) has available: the smaller of kvctl's and the server's view."""
    unbounded: tuple[str, ...]
    """Budgets without a limit (-1): they can take any amount."""

    @property
    def committed(self) -> int:
        return sum(self.parts.values())

    @property
    def fits(self) -> bool:
        return not self.unbounded and (self.available is None or self.growth <= self.available)


def host_budget(kv: KvSnapshot, host_available: int | None) -> HostBudget | None:
    """None: a server that does not report its host memory."""
    hm = kv.host_memory
    if hm is None:
        return None
    checkpoints_bound = max(hm.checkpoints_bytes, kv.n_slots * hm.ctx_checkpoints * hm.checkpoint_max_bytes)
    budgets = {
        "park_ram": (hm.park_ram_bytes, hm.park_ram_used_bytes),
        "cache_ram": (hm.cache_ram_bytes, hm.cache_ram_used_bytes),
        "checkpoints": (checkpoints_bound, hm.checkpoints_bytes),
    }
    parts = {"model": hm.model_bytes, "context": hm.context_bytes}
    growth = 0
    unbounded = []
    for name, (limit, used) in budgets.items():
        if limit is None:
            unbounded.append(name)
            parts[name] = used
        else:
            parts[name] = max(limit, used)
            growth += max(0, limit - used)
    views = [b for b in (host_available, kv.host_ram_available_bytes) if b is not None]
    return HostBudget(parts, growth, min(views) if views else None, tuple(unbounded))
