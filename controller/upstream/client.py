"""A typed aiohttp client for the patched llama-server: the only code that speaks its HTTP.

Every request carries ``X-Park-Lease: 1``, which renews the controller's lease on parked slots
(while it is held, the server leaves auto-parked slots to the controller). The API key, when
there is one, goes out as a bearer token and is never part of a log line, repr or error.
"""

from __future__ import annotations

import json
from types import TracebackType
from typing import Any, TypeVar

import aiohttp
from pydantic import BaseModel, SecretStr, TypeAdapter, ValidationError
from yarl import URL

from controller.upstream.models import ErrorEnvelope, KvSnapshot, ParkMode, ParkResult, ParkTier, ResumeResult, Slot

__all__ = [
    "LEASE_HEADER",
    "UpstreamApiError",
    "UpstreamClient",
    "UpstreamError",
    "UpstreamProtocolError",
    "UpstreamUnavailable",
]

LEASE_HEADER = "X-Park-Lease"

_M = TypeVar("_M", bound=BaseModel)
_SLOTS = TypeAdapter(tuple[Slot, ...])


class UpstreamError(Exception):
    """The server could not be asked, or did not answer as asked."""


class UpstreamUnavailable(UpstreamError):
    """No answer: refused, reset or timed out. The server is down, restarting or overloaded."""


class UpstreamProtocolError(UpstreamError):
    """An answer that is not what the patched server sends (not JSON, fields missing)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class UpstreamApiError(UpstreamError):
    """The server's own error answer: ``{"error": {"code", "message", "type"}}`` with its status."""

    def __init__(self, status: int, message: str, type_: str | None, retry_after_s: float | None) -> None:
        super().__init__(f"{status} {type_ or 'error'}: {message}")
        self.status = status
        self.message = message
        self.type = type_
        self.retry_after_s = retry_after_s

    @property
    def conflict(self) -> bool:
        """409: the slot serves another task, or is not in a state that allows the action."""
        return self.status == 409

    @property
    def unavailable(self) -> bool:
        """503: no room to resume, park budget exceeded, or a host allocation failed; retry later."""
        return self.status == 503


def _retry_after(headers: Any) -> float | None:
    value = headers.get("Retry-After")
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


KEEPALIVE_S = 1.0
# a park or resume is answered once its snapshot is copied, slice by slice between the other requests' decode
# steps (--park-slice): seconds for GiB snapshots on a busy server, so it waits longer than a poll; the control
# loop sizes it by the snapshot (ControlLoop.action_timeout_s), this is for callers that do not
COPY_TIMEOUT_S = 120.0


class UpstreamClient:
    """``GET /kv``, ``GET /slots``, ``GET /health``, ``GET /metrics``, park and resume."""

    def __init__(self, base_url: str, *, api_key: SecretStr | None = None, timeout_s: float = 2.0) -> None:
        self.base_url = URL(str(base_url).rstrip("/"))
        self._api_key = api_key
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    def __repr__(self) -> str:
        return f"UpstreamClient({str(self.base_url)!r})"

    def _headers(self) -> dict[str, str]:
        headers = {LEASE_HEADER: "1"}
        if self._api_key is not None:
            headers["Authorization"] = f"Bearer {self._api_key.get_secret_value()}"
        return headers

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # keep-alive, so a poll every 50 ms does not cost the server an accept and a handshake each; an
            # idle connection is dropped after KEEPALIVE_S, well before llama-server (cpp-httplib) closes it
            # at 5 s, so a reused connection is never one the server has just closed
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(keepalive_timeout=KEEPALIVE_S, limit=4), timeout=self._timeout
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> UpstreamClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def _request(
        self, method: str, path: str, body: dict[str, Any] | None = None, timeout_s: float | None = None
    ) -> tuple[int, bytes]:
        url = URL(f"{self.base_url}{path}")  # keeps a base path prefix and the query string
        data = json.dumps(body).encode() if body is not None else None
        headers = self._headers()
        if data is not None:
            headers["Content-Type"] = "application/json"
        try:
            # aiohttp sends an idempotent request (GET) once more when a kept-alive connection was closed under
            # it; a park or resume is never sent twice
            # the session's timeout unless the call names its own (passing None would mean no timeout at all)
            timeout = aiohttp.ClientTimeout(total=timeout_s) if timeout_s is not None else self._timeout
            async with self.session.request(method, url, data=data, headers=headers, timeout=timeout) as resp:
                payload = await resp.read()
                if resp.status >= 400:
                    raise self._api_error(resp.status, payload, resp.headers)
                return resp.status, payload
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError) as e:
            # a payload error: the answer was cut off (the server went away mid-body)
            raise UpstreamUnavailable(f"{method} {path}: {type(e).__name__}: {e}".rstrip(": ")) from None
        except aiohttp.ClientResponseError as e:
            raise UpstreamProtocolError(f"{method} {path}: {e.message}", e.status) from None
        except aiohttp.ClientError as e:  # any other client failure is no answer either, never a crash
            raise UpstreamUnavailable(f"{method} {path}: {type(e).__name__}: {e}".rstrip(": ")) from None

    @staticmethod
    def _api_error(status: int, payload: bytes, headers: Any) -> UpstreamError:
        try:
            env = ErrorEnvelope.model_validate_json(payload)
        except ValidationError:
            text = payload.decode("utf-8", "replace").strip()[:200] or "(empty body)"
            return UpstreamApiError(status, text, None, _retry_after(headers))
        return UpstreamApiError(status, env.error.message, env.error.type, _retry_after(headers))

    @staticmethod
    def _parse(model: type[_M], path: str, status: int, payload: bytes) -> _M:
        try:
            return model.model_validate_json(payload)
        except ValidationError as e:
            first = e.errors(include_url=False)[0]
            where = ".".join(str(p) for p in first["loc"])
            raise UpstreamProtocolError(
                f"{path}: unexpected answer ({where}: {first['msg']}); is this the patched llama-server?", status
            ) from None

    async def get_kv(self, timeout_s: float | None = None) -> KvSnapshot:
        status, payload = await self._request("GET", "/kv", timeout_s=timeout_s)
        return self._parse(KvSnapshot, "/kv", status, payload)

    async def get_slots(self) -> tuple[Slot, ...]:
        status, payload = await self._request("GET", "/slots")
        try:
            return _SLOTS.validate_json(payload)
        except ValidationError as e:
            raise UpstreamProtocolError(f"/slots: unexpected answer: {e.errors()[0]['msg']}", status) from None

    async def park(
        self,
        slot_id: int,
        id_task: int | None = None,
        mode: ParkMode | None = None,
        timeout_s: float | None = None,
        tier: ParkTier | None = None,
    ) -> ParkResult:
        """Park by ``mode``, its snapshot in ``tier`` (a server with tiers; ``none`` is a recompute); None: the
        server's choice (RAM, then disk, then recompute). An explicit swap or tier that does not fit is a 503."""
        path = f"/slots/{slot_id}?action=park"
        body: dict[str, Any] = {}
        if id_task is not None:
            body["id_task"] = id_task
        if mode is not None:
            body["mode"] = str(mode)
        if tier is not None:
            body["tier"] = str(tier)
        status, payload = await self._request("POST", path, body, timeout_s or COPY_TIMEOUT_S)
        return self._parse(ParkResult, path, status, payload)

    async def resume(self, slot_id: int, id_task: int | None = None, timeout_s: float | None = None) -> ResumeResult:
        path = f"/slots/{slot_id}?action=resume"
        body = {"id_task": id_task} if id_task is not None else {}
        status, payload = await self._request("POST", path, body, timeout_s or COPY_TIMEOUT_S)
        return self._parse(ResumeResult, path, status, payload)

    async def health(self) -> bool:
        """True once the model is loaded (200); False while it loads (503). Raises when nobody answers."""
        try:
            await self._request("GET", "/health")
        except UpstreamApiError as e:
            if e.status == 503:
                return False
            raise
        return True

    async def props(self) -> dict[str, Any]:
        """GET /props as a JSON object (``role`` is ``router`` in router mode)."""
        status, payload = await self._request("GET", "/props")
        try:
            doc = json.loads(payload)
        except ValueError:
            raise UpstreamProtocolError("/props: not JSON", status) from None
        return doc if isinstance(doc, dict) else {}

    async def model_ids(self) -> list[str]:
        """GET /v1/models: the ids of the models the server serves, in its order."""
        status, payload = await self._request("GET", "/v1/models")
        try:
            doc = json.loads(payload)
            return [str(m["id"]) for m in doc["data"]]
        except (ValueError, KeyError, TypeError):
            raise UpstreamProtocolError("/v1/models: not a model list", status) from None

    async def metrics_text(self) -> str:
        _, payload = await self._request("GET", "/metrics")
        return payload.decode("utf-8", "replace")
