"""What the control loop knows (LoopState): written by its roles (controller.loop.poller, controller.loop.actuator,
controller.loop.recorder), read by the admin API, the proxy's admission and the tests."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from controller.loop.gpu_room import NO_GPU, GpuRoom
from controller.policy.types import Decision, TaskHistory
from controller.probes.gpu import GpuReading
from controller.probes.host import HostMemory
from controller.upstream.models import KvSnapshot

__all__ = ["LoopState"]


@dataclass(slots=True)
class LoopState:
    """What the loop knows; read by the admin API and the tests, written only by the loop's task."""

    upstream_up: bool = False
    last_error: str | None = None
    last_error_status: int | None = None
    """The HTTP status of the last failed poll's answer (a 503 while loading, a 401 for a wrong key, a 200 kvctl could
    not read); None when the poll was answered fine or not at all."""
    error_answers: int = 0
    """Polls in a row answered with an error other than 503 (loading): a server that keeps answering so is not coming
    back by waiting (a wrong key, a server that is not the patched one)."""
    polls: int = 0
    last_poll_monotonic: float | None = None
    last_answer_monotonic: float | None = None
    """When the server last answered a poll at all (an API error is an answer: its main loop is not hung)."""
    snapshot_asked_monotonic: float | None = None
    """When the current snapshot was asked for: what the proxy admitted after it is not in it."""
    heartbeat_monotonic: float = field(default_factory=time.monotonic)
    busy_until_monotonic: float = 0.0
    """While the loop waits on a call to the server, when that call's own timeout ends: a long park is not a
    stalled loop (see ControlLoop.stalled())."""
    last_action_end_monotonic: float | None = None
    """When the last park or resume returned (answered or not): the hang check counts silence from there."""
    snapshot: KvSnapshot | None = None
    decision: Decision | None = None
    history: dict[int, TaskHistory] = field(default_factory=dict)
    unconfirmed_pins: set[int] = field(default_factory=set)
    """Tasks pinned by a manual park that timed out: the next poll says whether the park happened (and the pin
    stays) or not (it goes)."""
    host: HostMemory | None = None
    gpu: GpuReading | None = None
    """NVML's reading of the devices the server reports (None until read, or when it reports none)."""
    gpu_room: GpuRoom = NO_GPU
    """The server's devices, what others take of them, and whether that holds restores and admissions back."""
    parks: int = 0
    resumes: int = 0
    ends: int = 0
    action_failures: int = 0
    max_pressure: float = 0.0
    """The largest pressure seen at a poll since start (or since the last reset_maxima())."""
    max_growth: float = 0.0
    """The largest rise of the pressure between a decision's expectation and the next poll."""
    loop_restarts: int = 0
    backoff_s: float | None = None
    """The current back-off after failed polls; None while the server answers."""
