"""The patched llama-server as kvctl sees it: typed models and an aiohttp client."""

from controller.upstream.client import (
    LEASE_HEADER,
    UpstreamApiError,
    UpstreamClient,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamUnavailable,
)
from controller.upstream.models import (
    ErrorEnvelope,
    KvSnapshot,
    Lease,
    NextStep,
    ParkArena,
    ParkInfo,
    ParkMode,
    ParkRates,
    ParkResult,
    PoolInfo,
    ResumeResult,
    Slot,
    SlotState,
)

__all__ = [
    "LEASE_HEADER",
    "ErrorEnvelope",
    "KvSnapshot",
    "Lease",
    "NextStep",
    "ParkArena",
    "ParkInfo",
    "ParkMode",
    "ParkRates",
    "ParkResult",
    "PoolInfo",
    "ResumeResult",
    "Slot",
    "SlotState",
    "UpstreamApiError",
    "UpstreamClient",
    "UpstreamError",
    "UpstreamProtocolError",
    "UpstreamUnavailable",
]
