"""Why a greedy continuation depends on what else the server runs: each candidate cause switched off in turn.

    python -m bench.exact_causes [--model smollm2] [--tokens 96] [--rounds 2]

One server per row. Three target chats are run alone, one after the other (the reference); then the
same three at once with three others of longer prompts that arrive while the targets decode. A target
is *exact* when its token ids equal its solo run's. Each row turns off one path that the server's
output could depend on, so the rows that turn the divergence off name its causes:

- threads (``-t 2``): how ggml splits an op's rows between threads;
- flash attention on or off: two attention kernels;
- ``-nr``: no repacked weights (ggml's repacked Q4 kernels have a GEMM for several rows and a GEMV for one);
- per-slot pools (``-no-kvu``): each sequence's cells contiguous and alone, none of another's between them;
- ``-ub 1``: every step evaluates one token of one sequence, so the batch's width never changes.

This measures the causes for the batch-invariant mode (issue 51); it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from typing import Any

import aiohttp

from bench.common import build, cli, model, save, server, table
from testkit.llama import StreamResult, first_difference, stream_completion
from testkit.realmodels import user_turn

TARGETS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle works.",
    "List ten facts about the moon.",
]
OTHERS = [f"Summarise this text: {'The river ran past the old mill and the village. ' * n}" for n in (6, 14, 24)]

ROWS: list[tuple[str, tuple[str, ...], dict[str, str]]] = [
    ("default: -kvu, -t 1, -fa auto, repacked weights", (), {}),
    ("-t 2", ("-t", "2", "-tb", "2"), {}),
    ("-fa on", ("-fa", "on"), {}),
    ("-fa off", ("-fa", "off"), {}),
    ("-nr (no repacked weights)", ("-nr",), {}),
    ("-no-kvu (per-slot pools)", ("-no-kvu",), {}),
    ("-ub 1 (one token a step)", ("-ub", "1", "-b", "64"), {}),
    ("-ub 1 -no-kvu -nr", ("-ub", "1", "-b", "64", "-no-kvu", "-nr"), {}),
]
# --instrumented: a build of the same tree with three one-line switches in ggml-cpu (docs/parking.md,
# "Why a concurrent run differs"), named by KVCTL_BENCH_SERVER; a stock build ignores these variables
NO_SGEMM = {"KVCTL_EXP_NO_SGEMM": "1"}
SGEMM_ALL = {"KVCTL_EXP_SGEMM_ALL": "1"}
REF_FA = {"KVCTL_EXP_USE_REF": "1"}
INSTRUMENTED: list[tuple[str, tuple[str, ...], dict[str, str]]] = [
    ("tinyBLAS never (ggml's vec_dot for every matmul)", (), NO_SGEMM),
    ("tinyBLAS always (one-token matmuls too)", (), SGEMM_ALL),
    ("-fa on, the reference FA kernel (no tiles, no split KV)", ("-fa", "on"), REF_FA),
    ("-fa on, reference FA, tinyBLAS never", ("-fa", "on"), REF_FA | NO_SGEMM),
    ("-fa on, reference FA, tinyBLAS always", ("-fa", "on"), REF_FA | SGEMM_ALL),
    ("-fa on, reference FA, tinyBLAS always, -t 2", ("-fa", "on", "-t", "2", "-tb", "2"), REF_FA | SGEMM_ALL),
    ("-fa off, tinyBLAS always", ("-fa", "off"), SGEMM_ALL),
    ("-fa off, tinyBLAS always, -no-kvu", ("-fa", "off", "-no-kvu"), SGEMM_ALL),
]


async def one(
    s: aiohttp.ClientSession, url: str, prompt: str, tokens: int, delay: float = 0, model: str = "smollm2"
) -> StreamResult:
    await asyncio.sleep(delay)
    payload: dict[str, Any] = {"prompt": user_turn(model, prompt), "n_predict": tokens, "ignore_eos": True}
    payload["cache_prompt"] = False
    return await stream_completion(s, url, payload)


async def measure(url: str, tokens: int, model: str = "smollm2") -> list[int | None]:
    """Per target: None when the mixed run equals the solo one, else the index of the first different token."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True, limit=0)) as s:
        solo = [await one(s, url, t, tokens, model=model) for t in TARGETS]
        mixed = await asyncio.gather(
            *[one(s, url, t, tokens, model=model) for t in TARGETS],
            # the others arrive while the targets decode, one by one: prefill batches beside decode steps
            *[one(s, url, o, tokens, delay=0.4 + 0.3 * i, model=model) for i, o in enumerate(OTHERS)],
        )
    out: list[int | None] = []
    for a, b in zip(solo, mixed[: len(TARGETS)], strict=True):
        assert len(a.tokens) == tokens and len(b.tokens) == tokens, (a.error, b.error)
        out.append(first_difference(a.tokens, b.tokens))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="smollm2, gemma3, or a random-weight size (tiny, bench)")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2, help="mixed runs per row (schedules differ run to run)")
    ap.add_argument("--instrumented", action="store_true", help="also the rows of an instrumented build")
    args = ap.parse_args(argv)
    binary = build()
    gguf = model(args.model, binary)
    rows = []
    for name, flags, env in ROWS + (INSTRUMENTED if args.instrumented else []):
        base = ("-c", "4096", "-np", "8", "-kvu", "--slots", *flags)
        departures: list[int | None] = []
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            with server(binary, gguf, *base) as srv:
                for _ in range(args.rounds):
                    departures += asyncio.run(measure(srv.url, args.tokens, args.model))
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        exact = sum(d is None for d in departures)
        firsts = ", ".join("-" if d is None else str(d) for d in departures)
        rows.append((name, f"{exact}/{len(departures)}", firsts))
        print(rows[-1], flush=True)
    out = table(["server flags", "targets exact", "first different token (each target, each round)"], rows)
    head = f"{args.model}, {args.tokens} greedy tokens, 3 targets alone and beside 3 late arrivals"
    head += f", {args.rounds} rounds\n\n"
    print(head + out)
    save(f"exact_causes_{args.model}.md", head + out + "\n")
    return 0


if __name__ == "__main__":
    cli(main)
