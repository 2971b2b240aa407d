"""Host memory adds up (controller.loop.host_budget): the server's budgets against what the host has."""

from __future__ import annotations

from controller.loop.host_budget import host_budget
from controller.upstream.models import HostMemory
from testkit.snapshots import S, kv

MiB = 1 << 20


def snap(host_ram: int | None = None, **hm: int | None) -> object:
    base = kv(1000, [S("generating", 100), S("idle")], host_ram=host_ram)
    fields = {"model_bytes": 500 * MiB, "context_bytes": 200 * MiB, "park_ram_bytes": 8192 * MiB}
    fields |= {"cache_ram_bytes": 8192 * MiB, "ctx_checkpoints": 32, **hm}
    return base.model_copy(update={"host_memory": HostMemory(**fields)})  # type: ignore[arg-type]


def test_the_budgets_add_up_against_the_smaller_view() -> None:
    b = host_budget(snap(host_ram=20000 * MiB), 30000 * MiB)  # type: ignore[arg-type]
    assert b is not None
    assert b.parts == {
        "model": 500 * MiB,
        "context": 200 * MiB,
        "park_ram": 8192 * MiB,
        "cache_ram": 8192 * MiB,
        "checkpoints": 0,
    }
    assert b.committed == (500 + 200 + 8192 + 8192) * MiB
    assert b.growth == 16384 * MiB and b.available == 20000 * MiB and b.fits
    short = host_budget(snap(host_ram=16000 * MiB), None)  # type: ignore[arg-type]
    assert short is not None and not short.fits


def test_what_a_budget_holds_already_is_not_counted_twice() -> None:
    b = host_budget(snap(park_ram_used_bytes=8000 * MiB, cache_ram_used_bytes=100 * MiB), 8300 * MiB)  # type: ignore[arg-type]
    assert b is not None and b.growth == (192 + 8092) * MiB and b.fits


def test_checkpoints_count_every_slot_at_the_largest_seen() -> None:
    b = host_budget(snap(checkpoint_max_bytes=4 * MiB, checkpoints_bytes=12 * MiB), None)  # type: ignore[arg-type]
    assert b is not None and b.parts["checkpoints"] == 2 * 32 * 4 * MiB  # 2 slots x 32 x 4 MiB


def test_an_unbounded_budget_never_fits_and_an_older_server_says_nothing() -> None:
    b = host_budget(snap(park_ram_bytes=None, park_ram_used_bytes=64 * MiB), 10**15)  # type: ignore[arg-type]
    assert b is not None and b.unbounded == ("park_ram",) and b.parts["park_ram"] == 64 * MiB and not b.fits
    assert host_budget(kv(1000, [S("idle")]), None) is None
