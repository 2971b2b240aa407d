"""The text view of the status model (controller.admin.models.Status): what ``kvctl status`` prints on a terminal."""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import TextIO

from controller.admin.models import ExitView, GpuDeviceView, PoolView, SlotView, Status

# --- the text view of the status model -------------------------------------------------------------

BAR_WIDTH = 40


def utf8_stream(stream: TextIO) -> bool:
    encoding = getattr(stream, "encoding", None)
    if not encoding:
        return False
    try:
        return codecs.lookup(encoding).name == "utf-8"
    except LookupError:
        return False


def _pct(ratio: float) -> str:
    text = f"{ratio * 100:.1f}".removesuffix(".0")
    return f"{text} %"


def human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _duration(seconds: float) -> str:
    s = max(0.0, seconds)
    if s < 1:
        return f"{s * 1000:.0f} ms"
    if s < 60:
        return f"{s:.1f} s"
    whole = int(s)
    if whole < 3600:
        return f"{whole // 60}m {whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h {whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d {whole % 86400 // 3600:02d}h"


def pool_bar(used: float, high: float, low: float, *, unicode: bool, width: int = BAR_WIDTH) -> str:
    """``[█████░░░|░|░]``: the pool's occupancy, with LOW and HIGH as ``|`` between the cells they fall on."""
    full, empty = ("\u2588", "\u2591") if unicode else ("#", ".")

    def position(ratio: float) -> int:
        return round(min(1.0, max(0.0, ratio)) * width)

    filled = position(used)
    cells = [full] * filled + [empty] * (width - filled)
    for mark in sorted((position(low), position(high)), reverse=True):
        cells.insert(mark, "|")
    return "[" + "".join(cells) + "]"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], right: frozenset[int]) -> list[str]:
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    return [
        "  ".join(
            cell.rjust(width) if i in right else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in (header, *rows)
    ]


def _overall(status: Status) -> str:
    if status.degraded:
        return "degraded"
    return "ok" if status.ready else "ok, not ready"


def _upstream_line(status: Status) -> str:
    up = status.upstream
    parts = [up.state, up.url]
    if up.up and up.last_poll_age_s is not None:
        parts.append(f"polled {_duration(up.last_poll_age_s)} ago")
    if up.exact:
        parts.append("exact mode")
    if not up.up and up.last_error:
        parts.append(f"last error: {up.last_error}")
    if not up.up and up.backoff_s is not None:
        parts.append(f"retrying every {_duration(up.backoff_s)} or less")
    sup = status.supervisor
    if sup is not None:
        text = f"supervised: {sup.state}"
        if sup.pid is not None:
            text += f", pid {sup.pid}"
        text += f", {sup.restarts} restart" + ("" if sup.restarts == 1 else "s")
        if sup.early_exits:
            text += f", {sup.early_exits}" + (f" of {sup.failed_after}" if sup.failed_after else "") + " early exits"
        if sup.next_start_in_s is not None:
            text += f", next start in {_duration(sup.next_start_in_s)}"
        parts.append(f"({text})")
    return "  ".join(parts)


def _exit_text(last: ExitView) -> str:
    how = f"killed by {last.signal}" if last.signal is not None else f"exit code {last.returncode}"
    return f"{how} after {_duration(last.uptime_s)}" + (", before it was ready" if last.early else "")


def _supervisor_lines(status: Status) -> list[tuple[str, str]]:
    """The last exit (with the server's last lines once the supervisor gave up)."""
    sup = status.supervisor
    if sup is None or sup.last_exit is None:
        return []
    lines = [("last exit", _exit_text(sup.last_exit))]
    if sup.state == "failed":
        tail = sup.last_exit.log_tail or ["(nothing)"]
        lines += [("server log" if i == 0 else "", text) for i, text in enumerate(tail)]
    return lines


def _pool_lines(pool: PoolView | None, *, unicode: bool) -> list[tuple[str, str]]:
    if pool is None:
        return [("pool", "unknown (upstream down)")]
    bar = pool_bar(pool.used_ratio, pool.high, pool.low, unicode=unicode)
    projected = f"target {_pct(pool.projected_target)}"
    projected += f"  draft {_pct(pool.projected_draft)}" if pool.projected_draft is not None else "  no draft pool"
    if pool.swa is not None:
        projected += f"  window {_pct(pool.swa.projected)} of {pool.swa.n_cells} cells"
    projected += f"  peak {_pct(pool.max_pressure)}"
    if pool.above_high_s is not None:
        projected += f"  at or above HIGH for {_duration(pool.above_high_s)}"
    budget = f" of {human_bytes(pool.parked_budget_bytes)} budget"
    if pool.parked_budget_bytes > 0:
        budget += f" ({_pct(pool.parked_bytes / pool.parked_budget_bytes)})"
    requests = "request" if pool.n_parked == 1 else "requests"
    return [
        (
            "pool",
            f"{bar} {_pct(pool.used_ratio)}  HIGH {_pct(pool.high)}  LOW {_pct(pool.low)}"
            f"  ({pool.n_cells_used} of {pool.n_cells} cells)",
        ),
        ("projected", projected),
        ("parked", f"{pool.n_parked} {requests}, {human_bytes(pool.parked_bytes)}{budget}"),
        *_disk_lines(pool),
    ]


def _disk_lines(pool: PoolView) -> list[tuple[str, str]]:
    d = pool.disk
    if d is None:
        return []
    text = f"{human_bytes(d.used_bytes)} of {human_bytes(d.budget_bytes)} in {d.files} files under {d.dir}"
    rates = [
        f"{name} {human_bytes(int(rate))}/s"
        for name, rate in (("write", d.write_bytes_per_s), ("read", d.read_bytes_per_s))
        if rate
    ]
    text += f"  ({', '.join(rates)})" if rates else ""
    text += f"  {d.spills} moved from RAM" if d.spills else ""
    text += f"  {d.fallbacks} recomputed after a disk error" if d.fallbacks else ""
    return [("on disk", text)]


def _gpu_text(device: GpuDeviceView) -> str:
    name = f"#{device.index}" + (f" {device.name}" if device.name else "")
    if device.used_bytes is None or device.total_bytes is None:
        return f"{name}  memory not reported"
    text = f"{name}  {human_bytes(device.used_bytes)} used of {human_bytes(device.total_bytes)}"
    if device.free_bytes is not None:
        text += f" ({human_bytes(device.free_bytes)} free)"
    if device.server_bytes is not None and device.others_bytes is not None:
        text += f", the server {human_bytes(device.server_bytes)}, others {human_bytes(device.others_bytes)}"
        if device.others_growth_bytes:
            text += f" ({human_bytes(device.others_growth_bytes)} since it started)"
    return text


def _memory_lines(status: Status) -> list[tuple[str, str]]:
    if status.host_available_bytes is None:
        host = "unknown (not read yet)"
    else:
        host = f"{human_bytes(status.host_available_bytes)} available"
        if status.host_total_bytes is not None:
            host += f" of {human_bytes(status.host_total_bytes)}"
    lines = [("host RAM", host)]
    if status.gpu == "ok" and status.gpu_devices:
        lines += [("GPU", _gpu_text(d)) for d in status.gpu_devices]
        if status.gpu_held:
            lines.append(("GPU held", status.gpu_held))
    elif status.gpu == "ok":
        lines.append(("GPU", "no devices"))
    else:
        lines.append(("GPU", status.gpu))
    return lines


def _slot_row(slot: SlotView) -> list[str]:
    flags = [name for name, on in (("pinned", slot.pinned), ("auto", slot.auto_parked)) if on]
    if slot.park_mode is not None:
        flags.append("re-evaluating" if slot.recomputing else slot.park_mode)
        if slot.park_tier == "disk" and not slot.recomputing:
            flags.append("on disk")
    busy = slot.id_task is not None
    return [
        str(slot.id),
        slot.state,
        str(slot.n_cells) if busy or slot.n_cells else "-",
        _duration(slot.age_s) if slot.age_s is not None else "-",
        str(slot.n_decoded) if busy else "-",
        str(slot.park_count) if busy else "-",
        _duration(slot.waited_s) if slot.waited_s is not None else "-",
        _priority(slot) if busy else "-",
        " ".join(flags),
    ]


def _priority(slot: SlotView) -> str:
    """Its priority, and what it counts as when that differs (aged past policy.priority_max_wait_s)."""
    own = slot.priority if slot.priority is not None else 0
    eff = slot.effective_priority
    return f"{own}\u2192{eff}" if eff is not None and eff != own else str(own)


def render_status(status: Status, *, unicode: bool = True) -> str:
    """The text view: a header of labelled lines, then the slots table. ``unicode=False``: plain ASCII."""
    dot = " \u00b7 " if unicode else " - "
    title = f"kvctl {status.version}{dot}{_overall(status)}{dot}up {_duration(status.uptime_s)}"
    header: list[tuple[str, str]] = [("upstream", _upstream_line(status))]
    header += _supervisor_lines(status)
    if status.keeper is not None:
        k = status.keeper
        failed = f"; {k.reloads_failed} reload(s) failed, last: {k.last_reload_error}" if k.reloads_failed else ""
        header.append(("worker", f"pid {k.pid}, under the keeper (kvctl reload keeps every connection){failed}"))
        if k.listen_unchanged is not None:
            header.append(("problem", k.listen_unchanged))
    header += _pool_lines(status.pool, unicode=unicode)
    header += _memory_lines(status)
    header += [("problem", p) for p in status.problems]
    width = max(len(label) for label, _ in header)
    lines = [title, *(f"{label.ljust(width)}  {text}" for label, text in header), ""]
    if status.slots:
        rows = [_slot_row(s) for s in status.slots]
        columns = ("slot", "state", "cells", "age", "decoded", "parks", "parked for", "prio", "")
        if not unicode:
            rows = [[c.replace("\u2192", "->") for c in row] for row in rows]
        lines += _table(columns, rows, right=frozenset({0, 2, 3, 4, 5, 6, 7}))
        if any(s.pinned or s.auto_parked for s in status.slots):
            lines.append("pinned: parked by hand, stays parked until resumed by hand; auto: parked by the server's net")
        if any(s.park_mode is not None for s in status.slots):
            lines.append(
                "swap: its cells wait in host RAM (on disk: in a file of the server's disk tier); recompute: only its "
                "tokens are kept, evaluated again on resume (re-evaluating)"
            )
    else:
        lines.append("no slots (upstream down)" if status.pool is None else "no slots")
    return "\n".join(lines)
