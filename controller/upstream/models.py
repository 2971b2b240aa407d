"""The JSON shapes of the patched llama-server's /kv, /slots, park and resume (docs/patches.md, "Endpoints").

Unknown fields are ignored, so a newer server does not break an older controller; a missing field
fails parsing, so a server without the patches is reported as such instead of being misread. Fields
added by later patches (park modes and their costs) are optional: an older patched server still
parses, and its absence reads as what that server does (parks by swap only). A park mode this
controller does not know reads as None, or is left out of a list, for the same reason.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

__all__ = [
    "ErrorBody",
    "ErrorEnvelope",
    "HostMemory",
    "KvSnapshot",
    "Lease",
    "NextStep",
    "ParkDisk",
    "ParkInfo",
    "ParkMode",
    "ParkRates",
    "ParkResult",
    "ParkTier",
    "ParkTimings",
    "PoolInfo",
    "ResumeResult",
    "ResumeTimings",
    "Slot",
    "SlotState",
    "WindowPool",
]


class _Shape(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class PoolInfo(_Shape):
    """One KV pool (the target model's, or the draft model's)."""

    n_cells: int
    n_cells_used: int
    n_cells_free: int
    used_ratio: float
    source: str  # "exact" | "estimate"


class WindowPool(PoolInfo):
    """An iSWA model's sliding-window pool: a cell the window has left counts as free (the cache reuses it)."""

    n_swa: int
    """The model's window, in positions: the most cells one sequence holds in this pool."""


class NextStep(_Shape):
    """An upper bound of the cells the next decode step adds."""

    n_gen: int
    n_draft_max: int
    n_prompt_max: int
    n_total_max: int


class Lease(_Shape):
    held: bool
    ttl_s: float
    age_ms: float | None = None


class SlotState(StrEnum):
    IDLE = "idle"
    PROMPT = "prompt"
    GENERATING = "generating"
    PARKED = "parked"


class ParkMode(StrEnum):
    """How a request is parked."""

    SWAP = "swap"
    """Its cells are copied to host RAM (the snapshot's size) and copied back on resume."""
    RECOMPUTE = "recompute"
    """Its cells are freed, only its tokens kept; on resume the server evaluates them again, like a prompt."""


class ParkTier(StrEnum):
    """Where a parked request's cells are (patches 37-38): a swap's snapshot in host RAM or in a file on disk; none
    for a recompute, which keeps only the tokens."""

    RAM = "ram"
    DISK = "disk"
    NONE = "none"


_MODES = frozenset(m.value for m in ParkMode)
_TIERS = frozenset(t.value for t in ParkTier)


def _known_tier(value: object) -> object:
    return None if isinstance(value, str) and value not in _TIERS else value


def _known_tiers(value: object) -> object:
    if isinstance(value, list | tuple):
        return tuple(v for v in value if not isinstance(v, str) or v in _TIERS)
    return value


_Tier = Annotated[ParkTier | None, BeforeValidator(_known_tier)]


def _known_mode(value: object) -> object:
    """A mode of a newer server reads as None; anything but a string is left for the type check."""
    return None if isinstance(value, str) and value not in _MODES else value


def _known_modes(value: object) -> object:
    if isinstance(value, list | tuple):
        return tuple(v for v in value if not isinstance(v, str) or v in _MODES)
    return value


_Mode = Annotated[ParkMode | None, BeforeValidator(_known_mode)]


class ParkRates(_Shape):
    """What the server measured (moving averages); None: not measured yet."""

    copy_bytes_per_s: float | None = None
    """Host copy rate of swap parks and resumes."""
    prompt_tokens_per_s: float | None = None
    """Evaluation rate of prompts and re-evaluations."""
    wall_bytes_per_s: float | None = None
    """Rate of swap parks and resumes from request to answer (patch 24): a sliced copy spans several steps."""
    step_ms: float | None = None
    """A decaying peak of the server's main-loop iteration (patch 24): how long a request may wait behind one."""


class ParkInfo(_Shape):
    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True)

    count: int
    bytes: int
    n_cells: int | None = None
    """For a parked slot: the cells its resume needs (its full length), where the server reports it."""
    t_parked_total_ms: float
    parked_since_ms: int | None = None
    auto: bool = False
    test: bool = False
    mode: _Mode = None
    """The mode of the current park, or of the re-evaluation in progress."""
    recomputing: bool = False
    """Resumed by recompute and evaluating its tokens again (state ``prompt``)."""
    tier: _Tier = None
    """Parked: where its cells are; None when not parked, or from a server without a disk tier (then RAM for a swap)."""
    copying: str | None = Field(default=None, alias="copy")
    """``copy``: a copy of its snapshot in progress: "save" (a sliced park, a file being written back, a spill from RAM
    to disk) or "load" (a resume); None: none, or an older server."""
    snapshot_bytes: int | None = None
    """Generating: the exact host bytes a swap park of it would take now (n_cells x bytes_per_cell underestimates
    hybrid and iSWA models); swap-parked: the bytes it holds; recompute-parked: 0; otherwise, or from an older
    server, None."""


class Slot(_Shape):
    id: int
    id_task: int | None = None
    state: SlotState
    n_cells: int
    n_prompt: int = 0
    t_arrival_ms: int | None = None
    n_decoded: int = 0
    n_draft_max: int = 0
    request_id: str | None = None
    n_prefill_left: int = 0
    """Tokens still to evaluate before it generates: the rest of its prompt, or of a re-evaluation."""
    priority: int | None = None
    """Its request's priority (patch 25; higher = more important); None: idle, or a server that does not say."""
    park: ParkInfo

    @property
    def cells(self) -> int:
        """Cells the request holds; for a parked one, the cells its resume needs.

        A parked slot reports ``n_cells`` 0. At a quiescent point a generating sequence holds its
        prompt and every generated token but the last one sampled, which the next step decodes.
        """
        if self.state is not SlotState.PARKED:
            return self.n_cells
        if self.park.n_cells is not None:
            return self.park.n_cells
        return max(self.n_cells, self.n_prompt + max(0, self.n_decoded - 1))

    @property
    def is_resident(self) -> bool:
        """Holds cells for a request in progress (an idle slot's cells are only a prompt cache)."""
        return self.state in (SlotState.PROMPT, SlotState.GENERATING)


class ParkArena(_Shape):
    """``/kv`` ``park_arena``: host memory reserved for snapshots, grown on demand, kept ``keep_s`` unused."""

    bytes: int
    used_bytes: int
    chunks: int
    pinned: bool
    keep_s: int


class ParkDisk(_Shape):
    """``/kv`` ``park_disk`` (patch 35): the server's --park-disk directory for snapshots RAM does not hold."""

    dir: str
    budget_bytes: int
    used_bytes: int
    files: int
    writes: int = 0
    """Snapshots written whole since the server started."""
    reads: int = 0
    """Snapshots read back whole since the server started."""
    fallbacks: int = 0
    """Snapshots that could not be written or read back: their requests were recomputed."""
    spills: int | None = None
    """Snapshots moved from RAM to disk for a newer park of a higher priority (patch 40); None: a server that does not
    move them."""
    write_bytes_per_s: float | None = None
    """Park to disk, from its start until the file is written back (moving average); None: not measured yet."""
    read_bytes_per_s: float | None = None
    """Resume from disk, from the request until the copy back is done (moving average); None: not measured yet."""


class HostMemory(_Shape):
    """``/kv`` ``host_memory`` (patch 39): what the server takes and may take of host memory."""

    model_config = ConfigDict(extra="ignore", frozen=True, protected_namespaces=())  # model_bytes is the server's

    model_bytes: int
    """The models' weights in host buffers (mapped from the file or loaded): all of them on a CPU build."""
    context_bytes: int
    """KV caches and compute buffers in host buffers."""
    park_ram_bytes: int | None = None
    """--park-ram in bytes; None: no limit."""
    park_ram_used_bytes: int = 0
    """What the snapshot arena holds now."""
    cache_ram_bytes: int | None = None
    """--cache-ram (the idle slots' prompt cache) in bytes; None: no limit."""
    cache_ram_used_bytes: int = 0
    ctx_checkpoints: int = 0
    """--ctx-checkpoints: the most context checkpoints a slot keeps (iSWA and hybrid models take them)."""
    checkpoints_bytes: int = 0
    checkpoint_max_bytes: int = 0
    """The largest checkpoint held now; 0 for a model that takes none (or none taken yet)."""


class ServerIdentity(_Shape):
    """Which process answers (patch 22): a new boot id is a restarted server, whose task ids start again."""

    boot_id: str
    t_start_ms: int
    exact: bool | None = None
    """The server runs in the batch-invariant mode (`--exact`, patch 46): a request's tokens equal a solo run's
    whatever else runs; None from a server that does not say."""


class Device(_Shape):
    """A device the server's models run on (patch 22; none on a CPU build), as its backend sees it."""

    name: str
    description: str = ""
    device_id: str | None = None
    """The PCI bus id ("0000:c1:00.0") where the backend knows it: how NVML's device is matched."""
    memory_free_bytes: int
    memory_total_bytes: int
    buffers_bytes: int
    """What the server's own buffers (weights, KV pool, compute) take on it."""


class KvSnapshot(_Shape):
    """``GET /kv``: one snapshot taken between two decode steps."""

    n_cells: int
    n_cells_used: int
    n_cells_free: int
    used_ratio: float
    source: str
    draft: PoolInfo | None = None
    swa: WindowPool | None = None
    """An iSWA model's sliding-window pool; None: the model has none, or an older server."""
    bytes_per_cell: int
    next_step: NextStep
    n_slots: int
    n_slots_idle: int
    n_parked: int
    parked_bytes: int
    park_ram_budget_bytes: int | None = None
    """The server's --park-ram in bytes (None: no limit); 0 on a server that offers modes: recompute only."""
    park_modes: Annotated[tuple[ParkMode, ...] | None, BeforeValidator(_known_modes)] = None
    """The modes the server parks by: () parking off, (recompute,) with --park-ram 0, or both; None: an older
    server, which parks by swap only."""
    host_ram_available_bytes: int | None = None
    """The server's host memory available without swapping (MemAvailable); None: unknown."""
    host_memory: HostMemory | None = None
    """None: an older server, which does not say."""
    park_rates: ParkRates = ParkRates()
    park_arena: ParkArena | None = None
    """The host memory the server keeps for snapshots; None: an older server."""
    park_disk: ParkDisk | None = None
    """The server's disk tier; None: none (no --park-disk, or an older server)."""
    park_tiers: Annotated[tuple[ParkTier, ...] | None, BeforeValidator(_known_tiers)] = None
    """Where the server can keep a parked request's cells; None: a server without tiers (RAM when it swaps)."""
    server: ServerIdentity | None = None
    """None: an older server, which does not say (a restart is then told by the server going away)."""
    devices: tuple[Device, ...] | None = None
    """None: an older server, which does not say; (): a CPU build."""
    auto_park: bool = False
    auto_resume_ratio: float | None = None
    lease: Lease | None = None
    slots: tuple[Slot, ...] = ()


class ParkTimings(_Shape):
    park_ms: float
    """Wall time from the start of the park until its cells were free (a sliced copy spans iterations)."""
    copy_ms: float | None = None
    """Time spent copying the snapshot, summed over its slices; None: an older server."""


class ParkResult(_Shape):
    """200 answer of ``POST /slots/{id}?action=park``."""

    id_slot: int
    id_task: int
    action: str
    n_cells: int
    n_cells_draft: int = 0
    n_bytes: int
    n_bytes_draft: int = 0
    park_count: int
    timings: ParkTimings
    mode: _Mode = None
    """The mode it was parked by; None: an older server (swap)."""
    mode_reason: str | None = None
    """The server's words for its choice: "requested", or why a swap could not be held."""
    tier: _Tier = None
    """Where the cells went; None: a server without tiers."""
    fallback: str | None = None
    """Set when a snapshot on disk could not be written: why the request was parked by recompute instead."""


class ResumeTimings(_Shape):
    resume_ms: float
    copy_ms: float | None = None


class ResumeResult(_Shape):
    """200 answer of ``POST /slots/{id}?action=resume``."""

    id_slot: int
    id_task: int
    action: str
    n_cells: int
    n_bytes: int
    t_parked_ms: float
    timings: ResumeTimings
    mode: _Mode = None
    """The mode it had been parked by; a recompute resume answers at once and re-evaluates afterwards."""
    tier: _Tier = None
    """Where its cells came back from; None: a server without tiers."""
    fallback: str | None = None
    """Set when its snapshot on disk could not be read back whole: why it is recomputed instead."""


class ErrorBody(_Shape):
    code: int | str | None = None
    message: str
    type: str | None = None


class ErrorEnvelope(_Shape):
    error: ErrorBody
