"""Exactness of parks on trained weights: per model, KV cache type and flash-attention mode, swap and recompute.

    python -m bench.real_models [--every 8] [--models smollm2,gemma3]

Each prompt runs alone on one patched server (greedy): once unparked, then parked and resumed through the API
every ``--every`` tokens, by swap and by recompute. Prints, per case, the parks, whether the token ids and the
text equal the unparked run's, the first differing token, and the start of the answer served while parked.
On this CPU a model's greedy output also changes with the batch's composition, which is why each run is solo.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

import aiohttp

from bench.common import build, cli, model, save, server, table
from testkit.llama import StreamResult, first_difference, post_action, stream_completion
from testkit.realmodels import user_turn

LAYOUTS = {
    "f16, FA on": ("-fa", "on"),
    "f16, FA off": ("-fa", "off"),
    "q8_0, FA on": ("-fa", "on", "-ctk", "q8_0", "-ctv", "q8_0"),
}
LONG = " ".join(
    f"Chapter {i}. The lighthouse keeper wrote in the log that the ships came in at dawn, that the fog lifted by"
    " noon, and that the gulls followed the fishing boats back into the harbour before the evening bell."
    for i in range(1, 15)
)
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "country": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["city", "country", "population"],
}


PROMPTS: dict[str, list[tuple[str, str, int, dict[str, Any]]]] = {
    "smollm2": [
        ("chat", user_turn("smollm2", "Explain in three sentences why the sky is blue."), 96, {}),
        ("json_schema", user_turn("smollm2", "Describe Paris as JSON."), 96, {"json_schema": SCHEMA}),
        ("chinese", user_turn("smollm2", "Translate to Chinese: I love tea."), 48, {}),
    ],
    "gemma3": [
        ("prose past the window", LONG + "\nChapter 15.", 96, {}),
        ("cjk", "東京は日本の首都です。北京は中国の首都です。ソウルは", 48, {}),
    ],
}


async def one(url: str, req: dict[str, Any], every: int, mode: str | None) -> tuple[StreamResult, int]:
    parks = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:

        async def hook(res: StreamResult) -> None:
            nonlocal parks
            if mode is None or len(res.n_decoded) % every:
                return
            status, _, _ = await post_action(http, url, 0, "park", {"mode": mode})
            if status == 200:
                parks += 1
                await post_action(http, url, 0, "resume")

        res = await stream_completion(http, url, req, headers={"X-Token-Ids": "1"}, on_chunk=hook)
    return res, parks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--every", type=int, default=8, help="park and resume every N tokens")
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--out", default="real_models")
    args = ap.parse_args(argv)
    binary = build()
    rows = []
    for name in args.models.split(","):
        gguf = model(name, binary)
        for layout, flags in LAYOUTS.items():
            pool = ("-c", "4096", "-np", "2", "-kvu", "--slots", "--no-cache-idle-slots", *flags)
            with server(binary, gguf, *pool) as srv:
                for what, prompt, n, extra in PROMPTS[name]:
                    req = {"prompt": prompt, "n_predict": n, "temperature": 0, "cache_prompt": False, "id_slot": 0}
                    ref, _ = asyncio.run(one(srv.url, {**req, **extra}, args.every, None))
                    for mode in ("swap", "recompute"):
                        got, parks = asyncio.run(one(srv.url, {**req, **extra}, args.every, mode))
                        same = ref.announced_ids == got.announced_ids
                        div = first_difference(ref.announced_ids, got.announced_ids)
                        text = got.content.strip().replace("\n", " ").replace("|", "/")
                        rows.append(
                            (
                                name,
                                layout,
                                what,
                                mode,
                                parks,
                                same,
                                ref.content == got.content,
                                "-" if div is None else div,
                                (got.final or {}).get("stop_type"),
                                text[:60] + ("…" if len(text) > 60 else ""),
                            )
                        )
                        print(" | ".join(map(str, rows[-1])), file=sys.stderr, flush=True)
    head = f"greedy, each run solo, parked and resumed every {args.every} tokens; CPU build, -t 1\n\n"
    out = head + table(
        [
            "model",
            "KV",
            "prompt",
            "mode",
            "parks",
            "same ids",
            "same text",
            "first divergence",
            "stop",
            "answer served while parked",
        ],
        rows,
    )
    print(out)
    save(f"{args.out}.md", out + "\n")
    return 0 if all(r[5] for r in rows if r[3] == "swap") else 1


if __name__ == "__main__":
    cli(main)
