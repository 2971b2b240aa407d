"""Exactness under forced parks: byte and token-id equality against unparked runs.

    python bench/exactness.py [--n-predict 1000] [--interval 50]

Solo and concurrent streams, plain llama and Qwen3.5 with MTP drafting, each run twice: on a
server without parking and on one with --park-test-interval. Prints equality and, where runs
differ, the index of the first differing token.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import aiohttp

from bench.common import build, cli, model, save, server, table
from testkit.llama import NO_BYTE_TOKENS, StreamResult, first_difference, stream_completion


async def run(url: str, n_streams: int, n_predict: int, extra: dict[str, Any]) -> list[StreamResult]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True, limit=0)) as s:
        return await asyncio.gather(
            *[
                stream_completion(
                    s,
                    url,
                    {
                        "prompt": f"Prompt {i}: once upon a time",
                        "n_predict": n_predict,
                        "ignore_eos": True,
                        "cache_prompt": False,
                        **extra,
                    },
                )
                for i in range(n_streams)
            ]
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-predict", type=int, default=1000)
    ap.add_argument("--interval", type=int, default=50)
    args = ap.parse_args(argv)

    binary = build()
    rows = []
    cases = [
        ("llama tiny", model("tiny", binary), (), {"logit_bias": NO_BYTE_TOKENS}),
        ("qwen35 + MTP", model("qwen35", binary), ("--spec-type", "draft-mtp"), {}),
    ]
    for name, gguf, spec_args, extra in cases:
        for n_streams in (1, 4):
            base = ("-c", "16384", "-np", "4", "-kvu", "--slots", "--metrics", *spec_args)
            with server(binary, gguf, *base) as ref_srv:
                ref = asyncio.run(run(ref_srv.url, n_streams, args.n_predict, extra))
            with server(binary, gguf, *base, "--park-test-interval", str(args.interval)) as srv:
                got = asyncio.run(run(srv.url, n_streams, args.n_predict, extra))
            for i, (r, g) in enumerate(zip(ref, got, strict=True)):
                div = first_difference(r.tokens, g.tokens)
                rows.append(
                    (
                        name,
                        n_streams,
                        i,
                        g.comments.count("parked"),
                        r.content == g.content,
                        r.tokens == g.tokens,
                        "-" if div is None else div,
                    )
                )
    out = table(
        ["model", "streams", "stream", "forced parks", "same bytes", "same token ids", "first divergence"], rows
    )
    print(out)
    save("exactness.md", out + "\n")
    return 0 if all(r[4] and r[5] for r in rows if r[1] == 1) else 1


if __name__ == "__main__":
    cli(main)
