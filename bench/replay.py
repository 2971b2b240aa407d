"""How exact a continuation is: greedy runs continued from a cut (continuation_tokens) against uninterrupted ones.

    python -m bench.replay [--n-predict 800] [--prompts 4]

A crash replay (proxy.replay_limit) sends the request again with the token ids its client has; the server
evaluates them as part of the prompt, in a different batch than they were generated in. For each prompt, an
uninterrupted greedy run gives the reference; the same request is then continued from 25 %, 50 % and 75 % of its
tokens, alone and beside three other streams (a batch of four, as after a crash with several streams). Prints
whether the continued run's tokens equal the reference's and, where they do not, the first differing index
(counted from the start of the answer).
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import aiohttp

from bench.common import build, cli, model, save, server, table
from testkit.llama import NO_BYTE_TOKENS, first_difference, stream_completion


def body(i: int, n_predict: int, **extra: Any) -> dict[str, Any]:
    return {
        "prompt": f"Prompt {i}: once upon a time",
        "n_predict": n_predict,
        "ignore_eos": True,
        "cache_prompt": False,
        "logit_bias": NO_BYTE_TOKENS,
        **extra,
    }


async def run(url: str, n_prompts: int, n_predict: int) -> list[tuple[int, str, bool, int | str]]:
    rows: list[tuple[int, str, bool, int | str]] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True, limit=0)) as s:
        for i in range(n_prompts):
            ref = (await stream_completion(s, url, body(i, n_predict))).tokens
            for frac in (0.25, 0.5, 0.75):
                cut = int(n_predict * frac)
                for company in (0, 3):
                    others = [stream_completion(s, url, body(100 + j, n_predict)) for j in range(company)]
                    got, *_ = await asyncio.gather(
                        stream_completion(s, url, body(i, n_predict, continuation_tokens=ref[:cut])), *others
                    )
                    tokens = ref[:cut] + got.tokens
                    div = first_difference(ref, tokens)
                    rows.append(
                        (
                            i,
                            f"{cut} ({frac:.0%}), {'alone' if not company else 'batch of 4'}",
                            div is None,
                            "-" if div is None else div,
                        )
                    )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-predict", type=int, default=800)
    ap.add_argument("--prompts", type=int, default=4)
    args = ap.parse_args(argv)
    binary = build()
    with server(binary, model("tiny", binary), "-c", "16384", "-np", "4", "-kvu") as srv:
        rows = asyncio.run(run(srv.url, args.prompts, args.n_predict))
    out = table(["prompt", "continued from", "same token ids", "first divergence"], rows)
    same = sum(1 for r in rows if r[2])
    out += f"\n{same} of {len(rows)} continuations give the uninterrupted run's tokens exactly.\n"
    print(out)
    save("replay.md", out)
    return 0


if __name__ == "__main__":
    cli(main)
