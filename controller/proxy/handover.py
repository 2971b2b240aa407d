"""Handover: a moved stream's KV cells go to the peer through a file, so the peer does not prefill them again.

Where replicas share a machine (``proxy.handover_dir``: the directory every one of their servers writes slot files
to, ``--slot-save-path``), a drain hands a running or parked stream's cells over instead of having the peer
evaluate its prompt and tokens again (``bench/migrate.py``: a 4k-token context moves in 0.23 s instead of 40 s on
the CPU):

- here, the request's slot is saved to a file (``POST /slots/N?action=save``): a parked one before its stream is
  cut (patch 0034 writes it from the park snapshot), a running one just after (the save waits for the server to
  end the cut request, and the slot's cells are what it leaves);
- the continuation goes to the peer with ``X-Kvctl-Handover: <file>``; the peer's kvctl reads the file into one of
  its idle slots (``action=restore``) just before it sends the continuation on (``cache_prompt``): the server finds
  the cells by their tokens, in that slot or, where another request started meanwhile and a unified pool gave the
  idle slot's cells to the prompt cache (``--cache-ram``, on by default), there; it evaluates only what follows;
- this replica removes the file once the move is over, taken or not.

Anything that does not work (no slot found, a save or restore refused, another peer without the directory) leaves
the continuation as it is: the peer evaluates the tokens again, as without a handover. The file names are
kvctl's own (``kvctl-<hex>.bin``); a peer acts only on a name of that form, and only for a verified peer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import structlog

from controller.proxy.config import ProxyConfig
from controller.proxy.context import Inflight, RequestContext
from controller.proxy.forward import Upstream

__all__ = ["HANDOVER_HEADER", "Handover"]

log = structlog.get_logger("kvctl.drain")

HANDOVER_HEADER = "X-Kvctl-Handover"
_NAME = re.compile(r"^kvctl-[0-9a-f]{32}\.bin$")
_TIMEOUT_S = 60.0  # a save or restore of a large context moves GiB through the page cache
_TURN_S = 10.0  # the longest a restore waits for the one before it to be placed: past it, the peer prefills


class Handover:
    def __init__(self, config: ProxyConfig, upstream: Upstream) -> None:
        self.config = config
        self.upstream = upstream
        self.dir = Path(config.handover_dir) if config.handover_dir else None
        self._claimed: set[int] = set()  # slots a restore here has filled for a request still running
        # one restore at a time, until its request is placed: a request the server places itself may take the
        # idle slot another restore chose, and a restore into a busy slot waits until that request ends
        self._turn = asyncio.Lock()
        self._holder: str | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._restoring: int | None = None  # the slot the restore under way has claimed

    @property
    def enabled(self) -> bool:
        return self.dir is not None

    async def _slots(self) -> list[dict[str, Any]]:
        assert self.upstream.session is not None
        async with (
            asyncio.timeout(self.config.connect_timeout_s + 5),
            self.upstream.session.get(self.upstream.own_url("/slots"), headers=self.upstream.own_headers()) as r,
        ):
            data = await r.json(content_type=None) if r.status == 200 else []
        return data if isinstance(data, list) else []

    async def _action(
        self, slot: int, action: str, filename: str, timeout_s: float = _TIMEOUT_S
    ) -> dict[str, Any] | None:
        assert self.upstream.session is not None
        url = self.upstream.own_url(f"/slots/{slot}?action={action}")
        async with (
            asyncio.timeout(timeout_s),
            self.upstream.session.post(url, json={"filename": filename}, headers=self.upstream.own_headers()) as r,
        ):
            body = await r.read()
            if r.status != 200:
                log.warning("handover.refused", action=action, slot=slot, status=r.status, body=body[:200])
                return None
        answer = json.loads(body)
        return answer if isinstance(answer, dict) else None

    # --- the draining side ---------------------------------------------------------------------

    async def save(self, entry: Inflight) -> bool:
        """Save ``entry``'s slot (found by its request id) to a new file, cutting its stream before a running one's
        save and after a parked one's; ``entry.handover`` gets the file's name, or None. True when the stream was
        cut here (the caller cuts it otherwise)."""
        assert entry.handover is not None
        cut = False
        name: str | None = None
        try:
            cut, name = await self._save(entry)
        finally:
            if not entry.handover.done():
                entry.handover.set_result(name)  # whatever happened: replay waits for it
        return cut

    async def _save(self, entry: Inflight) -> tuple[bool, str | None]:
        cut = False
        name: str | None = None
        try:
            slot = next((s for s in await self._slots() if s.get("request_id") == entry.request_id), None)
            park = (slot.get("park") or {}) if slot is not None else {}
            parked = slot is not None and slot.get("state") == "parked" and park.get("mode") == "swap"
            if slot is not None and (parked or slot.get("state") == "generating"):
                if not parked:
                    cut = self._cut(entry)  # its cells stay in the slot once the server ends the request
                name = f"kvctl-{uuid.uuid4().hex}.bin"
                saved = await self._action(int(slot["id"]), "save", name)
                if saved is None:
                    self.discard(name)
                    name = None
                else:
                    log.info("handover.saved", request_id=entry.request_id, tokens=saved.get("n_saved"), file=name)
        except Exception as e:  # a save is an optimization: any failure leaves the continuation as it was
            log.warning("handover.save_failed", request_id=entry.request_id, error=str(e) or repr(e))
            self.discard(name)
            name = None
        return cut, name

    @staticmethod
    def _cut(entry: Inflight) -> bool:
        if entry.upstream is None:
            return False
        entry.upstream.close()
        return True

    def discard(self, name: str | None) -> None:
        if name is not None and self.dir is not None and _NAME.match(name):
            with contextlib.suppress(OSError):
                (self.dir / name).unlink()

    # --- the peer's side ------------------------------------------------------------------------

    async def restore(self, ctx: RequestContext) -> int | None:
        """A peer's continuation with a handover file: its cells into an idle slot here (one no other restore has
        claimed: a second restore there would replace them); the slot, claimed until ``release``. None: nothing
        changed."""
        name = ctx.request.headers.get(HANDOVER_HEADER, "")
        if not (self.dir is not None and _NAME.match(name) and (self.dir / name).is_file()):
            return None
        try:
            await asyncio.wait_for(self._turn.acquire(), _TURN_S)
        except TimeoutError:
            log.warning("handover.busy", request_id=ctx.request_id)
            return None
        self._holder = ctx.request_id
        ctx.on_response = lambda: self._placing(ctx.request_id)
        try:
            return await self._restore(ctx, name)
        except BaseException:
            self.release(self._restoring, ctx.request_id)  # cancelled (the moving replica hung up): not held
            raise

    async def _restore(self, ctx: RequestContext, name: str) -> int | None:
        slot: int | None = None
        self._restoring = None
        try:
            body = json.loads(ctx.body)
            idle = [
                int(s["id"])
                for s in await self._slots()
                if not s.get("is_processing") and s.get("state") == "idle" and int(s["id"]) not in self._claimed
            ]
            if not isinstance(body, dict) or not idle:
                return None
            slot = self._restoring = idle[0]
            self._claimed.add(slot)
            # a few seconds: a restore the server defers (the slot was taken meanwhile) is of no use
            restored = await self._action(slot, "restore", name, timeout_s=max(5.0, self.config.connect_timeout_s))
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError, KeyError, TypeError) as e:
            log.warning("handover.restore_failed", request_id=ctx.request_id, error=str(e) or repr(e))
            restored = None
        if restored is None or slot is None:
            self.release(slot, ctx.request_id)
            return None
        # no id_slot: with a unified pool the server gives an idle slot's cells to its prompt cache (--cache-ram)
        # when another request starts, and only a request it places itself looks for them there
        ctx.body = json.dumps({**body, "cache_prompt": True}).encode()
        log.info("handover.restored", request_id=ctx.request_id, slot=slot, tokens=restored.get("n_restored"))
        return slot

    def _placing(self, request_id: str | None) -> None:
        """The request a restore was for is sent (its response started, which the server answers before it places
        the request): the next restore goes once a slot shows it, or after a few seconds."""
        task = asyncio.ensure_future(self._placed(request_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _placed(self, request_id: str | None) -> None:
        deadline = asyncio.get_running_loop().time() + 5.0
        with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, ValueError):
            while self._holder == request_id and asyncio.get_running_loop().time() < deadline:
                if any(s.get("request_id") == request_id for s in await self._slots()):
                    break
                await asyncio.sleep(0.02)
        self._done(request_id)

    def _done(self, request_id: str | None) -> None:
        """The request a restore was for is placed, or over: the next restore may go."""
        if self._holder == request_id and self._turn.locked():
            self._holder = None
            self._turn.release()

    def release(self, slot: int | None, request_id: str | None) -> None:
        """The request is over: its slot is no longer claimed, and its turn ends if it had not."""
        if slot is not None:
            self._claimed.discard(slot)
        self._done(request_id)
