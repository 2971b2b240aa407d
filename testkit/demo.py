"""The quickstart's demo: a burst of concurrent chats that would overflow the pool.

    python -m testkit.demo --proxy URL --admin URL --server URL [--chats 4] [--tokens 3000] [--ctx N] [--question TEXT]

Asks one question and prints the answer (a real model answers it; --question '' skips it), then sends
the chats through kvctl's proxy with the openai SDK, then prints how many completed and how many parks
it took (kvctl's own and the server's safety net's). Exit 0 only if every chat completed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from collections.abc import Callable

import aiohttp
import openai
from prometheus_client.parser import text_string_to_metric_families

# a chat's prompt with its template (SmolLM2's ChatML: about 30 tokens)
PROMPT_CELLS = 30


async def chat(
    client: openai.AsyncOpenAI, i: int, tokens: int, on_token: Callable[[], None] | None = None
) -> tuple[bool, int, str]:
    """Chat ``i``, streamed, ``tokens`` long (``ignore_eos``): whether it got them all, how many, the error."""
    try:
        stream = await client.chat.completions.create(
            model="demo",
            messages=[{"role": "user", "content": f"Tell story number {i}."}],
            max_tokens=tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        n = 0
        async for chunk in stream:
            if on_token is not None and chunk.choices and chunk.choices[0].delta.content:
                on_token()
            if chunk.usage is not None:
                n = chunk.usage.completion_tokens
        return n == tokens, n, ""
    except openai.APIError as e:
        return False, 0, f"{type(e).__name__}: {e}"


async def metric(session: aiohttp.ClientSession, url: str, prefix: str) -> float:
    """The sum of every sample in ``url``'s /metrics whose name starts with ``prefix``."""
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    return sum(
        float(sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith(prefix)
    )


async def watch_pool(session: aiohttp.ClientSession, admin: str, peak: list[int]) -> None:
    """Keep ``peak`` at the most cells in use that kvctl's /status showed, and the pool's size."""
    while True:
        with contextlib.suppress(aiohttp.ClientError, KeyError, TypeError, ValueError):
            async with session.get(admin + "/status") as resp:
                pool = (await resp.json())["pool"]
            peak[:] = [max(peak[0], pool["n_cells_used"]), pool["n_cells"]]
        await asyncio.sleep(0.25)


async def ask(client: openai.AsyncOpenAI, question: str) -> str:
    answer = await client.chat.completions.create(
        model="demo",
        # SmolLM2-135M answers a bare question with noise; with a system turn it answers it
        messages=[{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": question}],
        max_tokens=96,
        temperature=0,
    )
    return (answer.choices[0].message.content or "").strip()


async def run(args: argparse.Namespace) -> int:
    client = openai.AsyncOpenAI(base_url=args.proxy + "/v1", api_key="demo", timeout=600)
    if args.question:
        print(f"demo: asked {args.question!r} through {args.proxy}", flush=True)
        print(f"demo: answer: {await ask(client, args.question)}", flush=True)
    async with aiohttp.ClientSession() as s:
        kvctl0 = await metric(s, args.admin, "kvctl_parks_total")
        auto0 = await metric(s, args.server, "llamacpp:slot_auto_parks_total")
        t0 = time.monotonic()
        print(f"demo: {args.chats} concurrent chats of {args.tokens} tokens each, through {args.proxy}", flush=True)
        if args.ctx:
            need = args.chats * (args.tokens + PROMPT_CELLS)
            print(
                f"demo: together they need about {need} KV cells and the pool has {args.ctx}: without kvctl, "
                "llama-server would fail every one of them ('Context size has been exceeded.') once it fills; "
                "kvctl parks some and resumes them when there is room",
                flush=True,
            )
        peak: list[int] = [0, 0]  # the most cells in use seen, of how many
        watch = asyncio.ensure_future(watch_pool(s, args.admin, peak))
        results = await asyncio.gather(*[chat(client, i, args.tokens) for i in range(args.chats)])
        wall = time.monotonic() - t0
        watch.cancel()
        kvctl_parks = await metric(s, args.admin, "kvctl_parks_total") - kvctl0
        auto_parks = await metric(s, args.server, "llamacpp:slot_auto_parks_total") - auto0
    await client.close()
    done = sum(ok for ok, _, _ in results)
    for i, (ok, n, err) in enumerate(results):
        print(f"  chat {i}: {'completed' if ok else 'FAILED'}, {n} tokens{(' - ' + err) if err else ''}")
    print(
        f"demo: {done}/{len(results)} chats completed in {wall:.1f} s; the pool peaked at {peak[0]}/{peak[1]} cells; "
        f"parks: {int(kvctl_parks)} by kvctl, "
        f"{int(auto_parks)} by the server's safety net"
    )
    return 0 if done == len(results) else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m testkit.demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--proxy", default="http://127.0.0.1:8080")
    ap.add_argument("--admin", default="http://127.0.0.1:8091")
    ap.add_argument("--server", default="http://127.0.0.1:8081")
    ap.add_argument("--chats", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=3000)
    ap.add_argument("--ctx", type=int, default=0, help="the server's pool (-c), to say how far the burst overflows it")
    ap.add_argument("--question", default="What is the capital of France?")
    return asyncio.run(run(ap.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
