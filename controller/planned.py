"""A planned restart of the spawned server (``POST /server/restart``, ``kvctl restart-server``): a new llama.cpp
build, a changed flag, a new quantization of the same model, and no chat lost.

The order, each step the mechanism crash replay already has:

1. the new command line is checked before anything stops: its model file exists, and it serves the same model as
   the old one (the file's name and size, ``--alias``, the KV cache types), else 409 ``model_changed`` unless
   ``force``;
2. new requests are held (the gate's "coming back", as during a crash restart);
3. the server is killed: every running and parked request is checkpointed already, by the token ids its client has
   (the proxy's transcripts), and a request it had not answered has shown its client nothing;
4. the supervisor starts the new command line at once (no restart delay, not counted as a crash);
5. every interrupted stream is continued on the new server from its ids (``continuation_tokens``), spliced per
   protocol, and every request it had not answered is sent again, as after a crash.

With ``force`` and another model, the requests that cannot be continued end first, each with its protocol's error
(``server_replaced``). The answer counts the requests moved (sent to the new server) and those that were not.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog

from controller.errors import Code, KvctlError
from controller.proxy.admission import AdmissionGate
from controller.proxy.app import Proxy
from controller.proxy.context import Inflight, Phase, Stop
from controller.upstream.supervisor import Supervisor

__all__ = ["ModelIdentity", "PlannedRestart", "RestartOutcome", "model_identity"]

log = structlog.get_logger("kvctl.restart")

_FLAGS = {
    "-m": "model",
    "--model": "model",
    "-a": "alias",
    "--alias": "alias",
    "-ctk": "cache_type_k",
    "--cache-type-k": "cache_type_k",
    "-ctv": "cache_type_v",
    "--cache-type-v": "cache_type_v",
}


@dataclass(frozen=True, slots=True)
class ModelIdentity:
    """What a continuation needs unchanged: the same weights (the file's name and size), the same model id, the same
    KV cache types."""

    model: str
    size: int
    alias: str | None
    cache_type_k: str
    cache_type_v: str

    def differences(self, other: ModelIdentity) -> list[str]:
        return [
            f"{name}: {getattr(self, name)!r} -> {getattr(other, name)!r}"
            for name in ("model", "size", "alias", "cache_type_k", "cache_type_v")
            if getattr(self, name) != getattr(other, name)
        ]


def model_identity(argv: Sequence[str]) -> ModelIdentity:
    """The identity of the model a llama-server command line serves; KvctlError (400) when it names no model file
    kvctl can read (``-hf`` downloads are not compared: give the file)."""
    values: dict[str, str] = {}
    for i, arg in enumerate(argv):
        flag, eq, inline = arg.partition("=")
        name = _FLAGS.get(flag)
        if name is None:
            continue
        value = inline if eq else (argv[i + 1] if i + 1 < len(argv) else "")
        values[name] = value
    path = values.get("model")
    if not path:
        raise KvctlError(400, Code.INVALID_ARGV, "the server's command line names no model file (-m FILE)")
    try:
        size = os.stat(path).st_size
    except OSError as e:
        raise KvctlError(400, Code.INVALID_ARGV, f"the model file {path} cannot be read: {e.strerror}") from None
    return ModelIdentity(
        model=Path(path).name,
        size=size,
        alias=values.get("alias"),
        cache_type_k=values.get("cache_type_k", "f16"),
        cache_type_v=values.get("cache_type_v", "f16"),
    )


@dataclass(frozen=True, slots=True)
class RestartOutcome:
    moved: int
    """Running and parked requests sent to the new server (continued from their ids, or sent again whole)."""
    failed: int
    """Those that were not: ended (another model, replay off for them) or not sent within proxy.replay_timeout_s."""
    seconds: float


class PlannedRestart:
    """One planned restart at a time; see the module docstring."""

    def __init__(
        self,
        supervisor: Supervisor,
        proxy: Callable[[], Proxy | None],
        gate: AdmissionGate,
        models: Callable[[], Awaitable[list[str] | None]],
        replay_timeout_s: float,
        reload_argv: Callable[[], list[str] | None] | None = None,
    ) -> None:
        self.supervisor = supervisor
        self._proxy = proxy
        self.gate = gate
        self._models = models
        self.replay_timeout_s = replay_timeout_s
        self._reload_argv = reload_argv
        self._lock = asyncio.Lock()

    def _new_argv(self, argv: list[str] | None) -> list[str]:
        """``argv`` (the admin API checked its form), else the settings' ``supervisor.spawn`` if it can be read again,
        else the command line the server runs with."""
        if argv is not None:
            return argv
        reloaded = self._reload_argv() if self._reload_argv is not None else None
        return reloaded if reloaded else self.supervisor.argv

    async def run(self, argv: list[str] | None = None, force: bool = False) -> RestartOutcome:
        if self._lock.locked():
            raise KvctlError(409, Code.RESTART_IN_PROGRESS, "a restart of the server is already under way")
        async with self._lock:
            return await self._run(argv, force)

    async def _run(self, argv: list[str] | None, force: bool) -> RestartOutcome:
        sup = self.supervisor
        if not sup.ready:
            raise KvctlError(409, Code.SERVER_NOT_READY, f"the server is not running ({sup.status.state})", 2)
        old_argv, new_argv = sup.argv, self._new_argv(argv)
        old_id, new_id = model_identity(old_argv), model_identity(new_argv)
        changed = old_id.differences(new_id)
        if changed and not force:
            detail = "; ".join(changed)
            raise KvctlError(
                409,
                Code.MODEL_CHANGED,
                f"the new command line serves another model ({detail}): running requests cannot continue on it; "
                'send {"force": true} to end them with an error and restart anyway',
            )
        t0 = time.monotonic()
        old_models = await self._models()
        proxy = self._proxy()
        moving = [e for e in (proxy.inflight.values() if proxy else ()) if e.state is not Phase.QUEUED]
        epoch = sup.status.restarts
        log.warning(
            "restart.planned", requests=len(moving), model_changed=bool(changed), argv0=new_argv[0], force=force
        )
        self.gate.server_down()  # new requests wait, as during a crash restart
        if changed and proxy is not None:
            proxy.tracker.end_sent(Stop.REPLACED)
        if not await sup.restart(new_argv):
            raise await self._roll_back(old_argv, "the new command line did not give a ready server")
        new_models = await self._models()
        if old_models is not None and new_models is not None and old_models != new_models and not force:
            raise await self._roll_back(old_argv, f"the new server serves {new_models}, not {old_models}")
        moved = await self._settled(moving, epoch)
        outcome = RestartOutcome(moved, len(moving) - moved, round(time.monotonic() - t0, 3))
        log.warning("restart.done", moved=outcome.moved, failed=outcome.failed, seconds=outcome.seconds)
        return outcome

    async def _roll_back(self, old_argv: list[str], why: str) -> KvctlError:
        """The old command line again: the held and interrupted requests go on there."""
        log.error("restart.rolled_back", reason=why)
        if not await self.supervisor.restart(old_argv):
            log.error("restart.roll_back_failed")
        return KvctlError(409, Code.MODEL_CHANGED, f"{why}; the server was started again with its old command line")

    async def _settled(self, moving: list[Inflight], epoch: int) -> int:
        """Until every request that was running is sent to the new server or has ended (proxy.replay_timeout_s at
        most); how many were sent."""
        deadline = time.monotonic() + self.replay_timeout_s
        proxy = self._proxy()
        while time.monotonic() < deadline:
            live = proxy.inflight if proxy is not None else {}
            if all(e.sent_epoch > epoch or e.request_id not in live for e in moving):
                break
            await asyncio.sleep(0.1)
        return sum(1 for e in moving if e.sent_epoch > epoch)
