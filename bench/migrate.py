"""Moving a request to another server: its KV snapshot handed over through a file, against token replay.

    python -m bench.migrate [--lengths 1024,4096,8000] [--models smollm2,kvheavy:1024,4096,bench:16384,32000]

A drain or a planned restart continues a request on another server from the token ids its client has
(``continuation_tokens``): the new server prefills the prompt and those tokens again. The alternative is to move
the request's KV cells themselves. On one box that can go through files, with what upstream llama-server has
(``--slot-save-path``, ``POST /slots/N?action=save|restore``): server A writes the slot's cells and tokens to a
file, server B reads them into a slot, and the continuation sent to that slot (``id_slot``, ``cache_prompt``)
reuses them as its cached prefix, so B evaluates only what follows.

For each model and context length, one request of that many prompt tokens generates 16 tokens on A, then:

- **replay**: B gets the continuation (prompt + the 16 ids) and answers its next token: a prefill of all of it;
- **snapshot**: A saves the slot to a file, B restores it into a slot, and the same continuation is sent there.

Prints each path's time to B's next token, the file's size and its write and read rates, and whether both paths
give the same next token. Both servers run on this machine, one after the other's step (never at once).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp

from bench.common import build, cli, model, save, server, table
from testkit.llama import ServerProcess

GENERATED = 16
TEXT = "The lighthouse keeper climbed the stairs at dusk, counting each step as the sea rose below. "


async def post(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[float, Any]:
    t0 = time.monotonic()
    async with http.post(url, json=body) as resp:
        data = await resp.json()
        assert resp.status == 200, data
    return time.monotonic() - t0, data


async def prompt_ids(http: aiohttp.ClientSession, url: str, n: int) -> list[int]:
    _, data = await post(http, url + "/tokenize", {"content": TEXT * (n // 10 + 1)})
    ids: list[int] = data["tokens"]
    assert len(ids) >= n, len(ids)
    return ids[:n]


async def measure(a: ServerProcess, b: ServerProcess, n: int, save_dir: Path) -> list[Any]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as http:
        prompt = await prompt_ids(http, a.url, n)
        first = {"prompt": prompt, "n_predict": GENERATED, "ignore_eos": True, "return_tokens": True, "id_slot": 0}
        _, done = await post(http, a.url + "/completion", first)
        generated = done["tokens"]
        cont = {"prompt": prompt, "continuation_tokens": generated, "n_predict": 1, "return_tokens": True}

        # replay: B prefills the prompt and the generated ids
        await post(http, b.url + "/slots/0?action=erase", {})
        t_replay, replayed = await post(http, b.url + "/completion", {**cont, "id_slot": 0, "cache_prompt": False})

        # snapshot: A's slot to a file, into B's slot 1, then the continuation there
        name = f"migrate-{n}.bin"
        t_save, saved = await post(http, a.url + "/slots/0?action=save", {"filename": name})
        await post(http, b.url + "/slots/1?action=erase", {})
        t_restore, restored = await post(http, b.url + "/slots/1?action=restore", {"filename": name})
        t_cont, moved = await post(http, b.url + "/completion", {**cont, "id_slot": 1, "cache_prompt": True})
        size = (save_dir / name).stat().st_size
        (save_dir / name).unlink()
        total = t_save + t_restore + t_cont
        reused = moved.get("timings", {}).get("prompt_n")
        return [
            n + GENERATED,
            round(t_replay, 3),
            round(total, 3),
            f"{t_save:.3f} + {t_restore:.3f} + {t_cont:.3f}",
            round(size / 2**20, 1),
            round(size / 2**30 / max(saved["timings"]["save_ms"] / 1000, 1e-9), 2),
            round(size / 2**30 / max(restored["timings"]["restore_ms"] / 1000, 1e-9), 2),
            reused,
            "snapshot" if total < t_replay else "replay",
            replayed["tokens"] == moved["tokens"],
        ]


@contextlib.contextmanager
def pair(binary: Path, gguf: Path, ctx: int, save_dir: Path) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    args = ("-c", str(2 * (ctx + 64)), "-np", "2", "-kvu", "--slot-save-path", str(save_dir) + os.sep)
    with server(binary, gguf, *args) as a, server(binary, gguf, *args) as b:
        yield a, b


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="1024,4096,8000", help="prompt tokens, for models without their own")
    ap.add_argument(
        "--models",
        default="smollm2,kvheavy:1024,4096,bench:16384,32000",
        help="model[:length,...] (testkit model names)",
    )
    args = ap.parse_args(argv)
    default_lengths = [int(x) for x in args.lengths.split(",")]
    binary = build()
    rows = []
    # "bench:16384,32000": a model's own lengths follow it
    specs: list[tuple[str, list[int]]] = []
    for part in args.models.split(","):
        if part.isdigit() and specs:
            specs[-1][1].append(int(part))
        elif ":" in part:
            name, first = part.split(":", 1)
            specs.append((name, [int(first)]))
        else:
            specs.append((part, list(default_lengths)))
    with tempfile.TemporaryDirectory(prefix="kvctl-migrate-") as tmp:
        save_dir = Path(tmp)
        for name, lengths in specs:
            gguf = model(name, binary)
            with pair(binary, gguf, max(lengths) + GENERATED, save_dir) as (a, b):
                for n in lengths:
                    rows.append([name, *asyncio.run(measure(a, b, n, save_dir))])
                    print(table(HEADERS, rows[-1:]).splitlines()[-1], flush=True)
    out = table(HEADERS, rows)
    print(out)
    save("migrate.md", out + "\n")
    return 0


HEADERS = [
    "model",
    "context tokens",
    "replay s",
    "snapshot s",
    "save + restore + continue s",
    "file MiB",
    "write GiB/s",
    "read GiB/s",
    "tokens B evaluated (snapshot)",
    "faster",
    "same next token",
]

if __name__ == "__main__":
    cli(main)
