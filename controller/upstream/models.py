"""The JSON shapes of the patched llama-server's /kv, /slots, park and resume (see README, "Endpoints").

Unknown fields are ignored, so a newer server does not break an older controller; a missing field
fails parsing, so a server without the patches is reported as such instead of being misread.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict

__all__ = [
    "ErrorBody",
    "ErrorEnvelope",
    "KvSnapshot",
    "Lease",
    "NextStep",
    "ParkInfo",
    "ParkResult",
    "ParkTimings",
    "PoolInfo",
    "ResumeResult",
    "ResumeTimings",
    "Slot",
    "SlotState",
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


class ParkInfo(_Shape):
    count: int
    bytes: int
    n_cells: int | None = None
    """Cells the snapshot restores into, where the server reports it."""
    t_parked_total_ms: float
    parked_since_ms: int | None = None
    auto: bool = False
    test: bool = False


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


class KvSnapshot(_Shape):
    """``GET /kv``: one snapshot taken between two decode steps."""

    n_cells: int
    n_cells_used: int
    n_cells_free: int
    used_ratio: float
    source: str
    draft: PoolInfo | None = None
    bytes_per_cell: int
    next_step: NextStep
    n_slots: int
    n_slots_idle: int
    n_parked: int
    parked_bytes: int
    park_ram_budget_bytes: int | None = None
    auto_park: bool = False
    auto_resume_ratio: float | None = None
    lease: Lease | None = None
    slots: tuple[Slot, ...] = ()


class ParkTimings(_Shape):
    park_ms: float


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


class ResumeTimings(_Shape):
    resume_ms: float


class ResumeResult(_Shape):
    """200 answer of ``POST /slots/{id}?action=resume``."""

    id_slot: int
    id_task: int
    action: str
    n_cells: int
    n_bytes: int
    t_parked_ms: float
    timings: ResumeTimings


class ErrorBody(_Shape):
    code: int | str | None = None
    message: str
    type: str | None = None


class ErrorEnvelope(_Shape):
    error: ErrorBody
