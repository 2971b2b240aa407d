"""Assemble bench/RESULTS.md from the tables the benchmark scripts wrote into bench/results/.

    python -m bench.report

Each section names the exact command that produced it; the header names the machine.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess

from bench.common import RESULTS, ROOT, cli

SECTIONS = [
    (
        "pressure.md",
        "Pressure: every request completes when the pool overflows",
        "python -m bench.pressure",
        "Bands of context size x workload x mode, one run. `upstream` is the unpatched pinned server, `safety-net` "
        "the patched server alone, `kvctl` the patched server with its safety net off behind `kvctl run` (proxy "
        "and controller), `kvctl-seed` the same with the seed's restore order. Parked waits are measured by the "
        "client between the `: parked` and `: resumed` comments; slowdown is a request's time over the same "
        "request run solo; `schedule` is a digest of which requests were parked and resumed, in what order (the "
        "same digest for `kvctl` and `kvctl-seed`: the two orders made the same decisions).",
    ),
    (
        "pressure-park-ram.md",
        "Pressure with a budget smaller than one snapshot: parks by recompute",
        "python -m bench.pressure --quick --park-ram 1 --modes upstream,safety-net,kvctl --out pressure-park-ram",
        "The 8192 band twice: with the default `--park-ram` (8 GiB, every snapshot fits) and with `--park-ram 1` "
        "(1 MiB, less than one request's snapshot of ~2000 cells): the patched server and kvctl then park by "
        "recompute (the `(N rc)` in the parks column). Upstream has no such flag and runs as in the first pass. "
        "Before issue 16, the safety net alone completed 0 of 4 requests of this band at `--park-ram 1`.",
    ),
    (
        "proxy_ab.md",
        "The proxy before and after the stage split (issue 33)",
        "python -m bench.proxy_ab --before f5fee5c --rounds 30",
        "One patched server and three ways to it, in rotating order each round: direct, kvctl at `f5fee5c` (the "
        "1,547-line proxy, from a git worktree) and kvctl as the checkout has it (the proxy split by request "
        "stage). Medians with their interquartile range, and the paired per-round ratios with 95 % intervals: "
        "the split costs nothing measurable where the interval of `now / before` covers 1.",
    ),
    (
        "overhead.md",
        "Cost when parking never fires",
        "python -m bench.overhead --pairs 100",
        "Paired A/B runs alternating ABBA on the same two resident servers, the servers pinned to one core and the "
        "client and kvctl to the other (as a sidecar with its own CPU request runs); the mean ratio B/A of client "
        "throughput and of the server's CPU seconds per token (schedstat), each with its 95 % confidence interval. "
        "A control run of two unpatched servers (A/A, 30 pairs, 4 streams) gave 1.002 ± 0.013. The patched "
        "server's 4 % edge at 4 streams reproduced in two 100-pair runs (1.051 ± 0.013, 1.041 ± 0.010) but not "
        "in 15-30-pair runs on fresh servers (1.00-1.02); its cause is not identified.",
    ),
    (
        "policy_sim.md",
        "Restore order without the noise: kvctl's order against the seed's, simulated",
        "python -m bench.policy_sim",
        "The real `decide()` and `admission()` on a step-exact model of the server (one cell per generating "
        "request per decode step, prompts in 512-token chunks, the controller polling every 16 steps, ~50 ms), "
        "so both restore orders are compared on the same clock, in decode steps: the pressure workloads "
        "themselves, then seeded random mixes of 4 to 16 requests. New requests wait in kvctl's admission queue "
        "(highest priority first, first come first served within). The last table (issue 20, "
        "`--only priority` alone) runs priority workloads twice, with their priorities and with every priority 0: "
        "how soon the high-priority requests finish, how long the low ones wait, and aging bounding that wait.",
    ),
    (
        "park_cost.md",
        "Park and resume cost against snapshot size, swap and recompute",
        "python -m bench.park_cost",
        "Swap: the server's own park_ms/resume_ms for a generating request, next to a numpy copy of the same "
        "bytes. Recompute: the park's round trip, and the resume until the stream's next token (the server "
        "evaluates the request's tokens again, then decodes a step), beside the server's prompt_ms for a fresh "
        "prompt of the same length; the last column is their ratio (issue 16: about a prefill, no more). "
        "Recompute rows above 4096 cells are one measurement each.",
    ),
    (
        "park_speed.md",
        "Park at memory speed: bandwidth, decode stall and RSS (issue 17, before patches 30 and 31)",
        "python -m bench.park_speed",
        "The kvheavy model (512 KiB of f32 KV a cell), four streams whose cells interleave; stream 0 is parked "
        "and resumed through the API at each size, twice (the first park grows the arena). GB/s is the snapshot "
        "over the server's own `timings.copy_ms` (the copy and reading the cell layout, summed over slices), "
        "beside a numpy memcpy of a buffer 4x the last-level cache in the same run, and beside numpy doing the "
        "same layout's copy (every 4th 8 KiB row; with `-fa off`, V every 4th f32 element): what this machine's "
        "memory gives that layout. The stall is the other streams' longest gap between tokens from the park "
        "request to stream 0's next token, against their gaps just before; the bound is the issue's target "
        "(that longest gap + 2 decode steps + 5 ms). `--park-slice 0` is a park copied at once (no slicing), for "
        "comparison. Between two steps a sliced copy runs as long as the last step took (`--park-slice-ms -1`), "
        "so park_ms is about twice copy_ms on a busy server. With `-fa off` V is stored transposed: a stream's V "
        "elements lie one in every four, so that half of the copy is a gather that reads four times the bytes it "
        "copies, and libllama's state writer visits each channel of each cell (one call per element), which "
        "dominates the time: that layout parks at a few % of memcpy.",
    ),
    (
        "park_speed_1g.md",
        "Park at memory speed: a 1 GiB snapshot (issue 17, before patches 30 and 31)",
        "python -m bench.park_speed --sizes 1024 --prompt-mib 960 --slices 16M --out park_speed_1g",
        "As above at 1 GiB. Decoding 2048 tokens in four streams takes about half an hour a mode on 2 cores, "
        "so each stream starts from a 960 MiB prompt, prefilled in runs of up to a ubatch of consecutive cells, "
        "and only its last ~128 cells interleave cell by cell: the K and V rows of this layout are mostly "
        "contiguous runs.",
    ),
    (
        "park_speed_contiguous_f32.md",
        "Park in every cache layout: one long request beside three streams, f32 (issue 35)",
        "python -m bench.park_speed --model kv64 --sizes 192 --prompt-mib 190 --long one --slices 16M --fa on,off "
        "--cache f32 --rss off --out park_speed_contiguous_f32",
        "Issue 35's setup: the kv64 model (64 layers of 64 KV channels, 32 KiB of f32 KV a cell, rows of 68 to "
        "256 bytes), stream 0 a ~6,000-cell request (a long prompt, prefilled in runs of contiguous cells, then "
        "generation) beside three short streams, parked and resumed through the API four times (the first park "
        "grows the arena). GB/s is the snapshot over the server's own `timings.copy_ms` (the copy and reading "
        "the cell layout, summed over slices), the best of the last three, against numpy's memcpy of a buffer "
        "at least 4x the last-level cache in the same run, and against numpy copying the same layout (K one "
        "block; a transposed V, with -fa off, each channel's run of the request's cells out of its row of the "
        "pool's cells: strided reads a row apart). The bound is the issue's: the other streams' longest "
        "gap between tokens from the park request to stream 0's next token within 2 of their decode steps "
        "(median gap without a park) + 5 ms.",
    ),
    (
        "park_speed_contiguous_f16.md",
        "Park in every cache layout: one long request beside three streams, f16 (issue 35)",
        "python -m bench.park_speed --model kv64 --sizes 96 --prompt-mib 95 --long one --slices 16M --fa on,off "
        "--cache f16 --rss off --out park_speed_contiguous_f16",
        "As above with an f16 cache: the same ~6,000 cells.",
    ),
    (
        "park_speed_contiguous_q8_0.md",
        "Park in every cache layout: one long request beside three streams, q8_0 (issue 35)",
        "python -m bench.park_speed --model kv64 --sizes 51 --prompt-mib 50 --long one --slices 16M --fa on "
        "--cache q8_0 --rss off --out park_speed_contiguous_q8_0",
        "As above with a q8_0 cache: the same ~6,000 cells (a quantized V cache needs flash attention).",
    ),
    (
        "park_speed_sweep_f16.md",
        "Park in every cache layout: snapshot sizes, f16 (issue 35)",
        "python -m bench.park_speed --model kv64 --sizes 16,64,256 --prompt-mib auto --long one --slices 16M "
        "--fa on,off --cache f16 --rss off --out park_speed_sweep_f16",
        "As above, each size on its own server, stream 0's prompt holding all but 1 MiB of it (one contiguous "
        "run of cells; the pool four times that). 1 GiB of this model's f16 cache is 64k cells, whose prefill "
        "does not fit a session on 2 cores: 1 GiB is measured on kvheavy below. A 16 MiB snapshot fits in the "
        "last-level cache, so numpy's copy of its layout runs at cache speed, and a park's fixed costs (reading "
        "the cell layout, taking the cells) weigh more.",
    ),
    (
        "park_speed_sweep_q8_0.md",
        "Park in every cache layout: snapshot sizes, q8_0 (issue 35)",
        "python -m bench.park_speed --model kv64 --sizes 16,64 --prompt-mib auto --long one --slices 16M --fa on "
        "--cache q8_0 --rss off --out park_speed_sweep_q8_0",
        "As above with a q8_0 cache (256 MiB of it is 30k cells, a prefill beyond a session on 2 cores).",
    ),
    (
        "park_speed_sweep_1g_f16.md",
        "Park in every cache layout: a 1 GiB snapshot, f16 (issue 35)",
        "python -m bench.park_speed --model kvheavy --sizes 1024 --prompt-mib auto --long one --slices 16M "
        "--fa on,off --cache f16 --rss off --out park_speed_sweep_1g_f16",
        "1 GiB on the kvheavy model (256 KiB of f16 KV a cell: 4,096 cells, a prefill that fits), one long "
        "request beside three short streams, on its own server.",
    ),
    (
        "park_speed_stall_interleaved.md",
        "Park in every cache layout: cells interleaved with three other streams' (issue 35)",
        "python -m bench.park_speed --model kv64 --sizes 32 --slices 16M --fa on,off --cache f32,f16,q8_0 "
        "--rss off --out park_speed_stall_interleaved",
        "The same model, four streams decoding together from short prompts, so stream 0's cells lie one in every "
        "four: K (and V with flash attention on) is a gather of rows of 68 to 256 bytes, V with flash attention "
        "off (stored transposed) a gather of single 2- or 4-byte elements. 'same layout by numpy' is numpy "
        "doing that copy on buffers of the same shape: what this machine's memory gives the layout, the bound "
        "a park of it is held to.",
    ),
    (
        "exactness.md",
        "Exactness under forced parks",
        "python -m bench.exactness",
        "`--park-test-interval 50`: each stream is parked and resumed every 50 tokens, compared with the same "
        "streams on a server that never parks.",
    ),
    (
        "real_models.md",
        "Exactness on trained weights (issue 32)",
        "python -m bench.real_models",
        "SmolLM2-135M-Instruct Q4_1 and Gemma 3 270M Q4_K_M (6 min on 2 cores), each prompt solo on the patched "
        "CPU build (`-t 1`), unparked and then parked and resumed through the API every 8 tokens, per KV type and "
        "flash-attention mode. Swap: 15 of 15 cases give the unparked run's token ids and text. Recompute: 11 of "
        "15; the other four match up to the first divergence (tokens 9 to 68, always after the first park) and "
        "then continue validly: a recompute resume "
        "evaluates the tokens again as a batched prefill, whose last bits differ from the decode steps', and a "
        "greedy near-tie flips. Every answer in the last column was served while parked.",
    ),
    (
        "pressure-smollm2.md",
        "Pressure on a real model: SmolLM2-135M-Instruct (issue 32)",
        "python -m bench.pressure --model smollm2 --bands 4096 --workloads equal-long,late-prompts "
        "--modes upstream,kvctl --out pressure-smollm2",
        "The pressure benchmark's burst on trained weights (Q4_1, `-t 1`), in a 4096-cell pool: the same columns "
        "as the first table.",
    ),
    (
        "overhead-smollm2.md",
        "Cost when parking never fires, on SmolLM2-135M-Instruct (issue 32)",
        "python -m bench.overhead --model smollm2 --pairs 20 --n-predict 128 --out overhead-smollm2",
        "The paired A/B runs of the cost table on trained weights, 20 pairs (the spread is wider than the "
        "100-pair table's).",
    ),
    (
        "park_cost-smollm2.md",
        "Park and resume cost on SmolLM2-135M-Instruct (issue 32)",
        "python -m bench.park_cost --model smollm2 --cells 256,1024,4096 --repeat 3 --out park_cost-smollm2",
        "The park-cost table on trained weights: SmolLM2's f16 cache is 30 layers x 192 KV dims, 22.5 KiB a cell.",
    ),
    (
        "policy_scale.md",
        "Policy at scale",
        "python -m bench.policy_scale",
        "Decision time of the pure policy on simulated /kv snapshots of 4 to 1024 slots.",
    ),
    (
        "gpu-pressure.md",
        "GPU: pressure",
        "bench/gpu.sh",
        "The 0.85 B-parameter `gpu` model, every layer on the GPU, 8192 band.",
    ),
    (
        "gpu-overhead.md",
        "GPU: cost when parking never fires",
        "bench/gpu.sh",
        "As on the CPU, 20 pairs of 128 tokens.",
    ),
    (
        "endpoint.md",
        "kvctl as an inference gateway's endpoint (llm-d)",
        "python -m bench.endpoint",
        "The public `GET /metrics` scraped every 50 ms as llm-d's endpoint picker does, idle and under 64 streams "
        "(target: p99 under 10 ms), and its render alone; then two replicas, each server on its own core, fed long "
        "and short answers alternately (twice one pool in all) by round robin or by a tiny router that reads the "
        "gauges (lowest KV usage, then the shortest queue). Round robin sends every long answer to one replica, "
        "which parks; the gauges spread them.",
    ),
    (
        "replay.md",
        "Crash replay: how exact a continuation is",
        "python -m bench.replay",
        "Greedy runs of the tiny model continued from 25, 50 and 75 % of their tokens (`continuation_tokens`, what "
        "kvctl sends after a server crash), alone and beside three other streams, against the uninterrupted run. "
        "The continued tokens are evaluated as prompt batches, not one by one as they were generated: where the "
        "floating-point sums differ enough to change an argmax, the run diverges from there on, as after a park by "
        "recompute.",
    ),
    (
        "proxy_auth.md",
        "What the proxy's authentication costs",
        "python -m bench.proxy_auth",
        "Per-request latency on one patched server with `--api-key`, direct and through kvctl in each auth mode, "
        "interleaved request by request; p50 added is against direct. The proxy runs without a control loop, "
        "pinned to the other core. The server-checked mode asks the server about a credential once per "
        "`auth_cache_s` (5 s), so its cost is the relay's, not a round trip per request.",
    ),
    (
        "overload.md",
        "Side by side under overload, measured by aiperf",
        "python -m bench.overload",
        "aiperf 0.13.0 sends the same streamed chats (log-normal prompt and answer lengths, answers forced to their "
        "length) to four systems on one pool: upstream llama-server, upstream behind LiteLLM with 3 retries, kvctl, "
        "LiteLLM in front of kvctl. 1x is the most chats at once the pool holds whole; the rate rows are Poisson "
        "arrivals. A request completed when its stream ended with the server's usage; `stream_cut` is a stream "
        "that ended with the server's SSE error event instead (aiperf counts it a success). How each figure is "
        "computed: docs/benchmarks.md.",
    ),
    (
        "overload-quick.md",
        "Side by side under overload, quick",
        "python -m bench.overload --quick",
        "The same at 1x and 2x with 8 and 16 chats: the five-minute version.",
    ),
    (
        "soak.md",
        "Soak",
        "python -m bench.soak --minutes 10 --streams 16 --via-proxy",
        "16 concurrent streams through kvctl's proxy with forced parks every 50 tokens.",
    ),
]


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    return (
        f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB RAM, no GPU, {platform.system()} "
        f"{platform.release()}, Python {platform.python_version()}, kvctl commit {commit}, "
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d}"
    )


def after_rss(row: dict[str, str]) -> str:
    """park_speed's RSS after the last resume (its header names --park-arena-keep)."""
    return next(v for k, v in row.items() if "after the last resume" in k)


def rows(name: str, which: int = 0) -> list[dict[str, str]]:
    """The rows of the ``which``-th markdown table in bench/results/NAME, as dicts by header."""
    path = RESULTS / name
    if not path.exists():
        return []
    tables: list[list[list[str]]] = [[]]
    for line in path.read_text().splitlines():
        if line.startswith("|"):
            tables[-1].append([c.strip() for c in line.strip().strip("|").split("|")])
        elif tables[-1]:
            tables.append([])
    tables = [t for t in tables if t]
    if which >= len(tables):
        return []
    head, *body = tables[which]
    return [dict(zip(head, r, strict=False)) for r in body[1:]]


def floors() -> str:
    """Issue 8's floors, checked against the tables (the data decides, not this text)."""
    out = ["| floor | measured | met |", "|---|---|---|"]

    def add(floor: str, measured: str, met: bool | None) -> None:
        out.append(f"| {floor} | {measured} | {'n/a' if met is None else 'yes' if met else '**no**'} |")

    p = rows("pressure.md")
    if p:
        ours = [r for r in p if r["mode"] in ("kvctl", "safety-net")]
        ok = all(r["completed"].split("/")[0] == r["completed"].split("/")[1] and r["errors"] == "0" for r in ours)
        up_fail = sum(1 for r in p if r["mode"] == "upstream" and r["errors"] != "0")
        cells = len({(r["n_ctx"], r["workload"]) for r in p})
        add(
            "every request completes with kvctl, zero errors; upstream fails some",
            f"{sum(int(r['completed'].split('/')[0]) for r in ours)}/"
            f"{sum(int(r['completed'].split('/')[1]) for r in ours)} completed (kvctl and safety-net); "
            f"upstream failed in {up_fail} of {cells} cells",
            ok and up_fail > 0,
        )
        worse, noise, compared = [], [], 0
        for r in p:
            if r["mode"] == "kvctl":
                seed = next(
                    (
                        q
                        for q in p
                        if q["mode"] == "kvctl-seed" and q["n_ctx"] == r["n_ctx"] and q["workload"] == r["workload"]
                    ),
                    None,
                )
                if seed is None:
                    continue
                compared += 1
                if float(r["max parked s"]) > float(seed["max parked s"]):
                    cell = f"{r['n_ctx']} {r['workload']}: {r['max parked s']} s vs {seed['max parked s']} s"
                    same = r.get("schedule") not in (None, "-") and r.get("schedule") == seed.get("schedule")
                    (noise if same else worse).append(cell)
        measured = f"at or below in {compared - len(worse) - len(noise)} of {compared} cells"
        if noise:
            measured += (
                "; longer with the same schedule of parks and resumes as the seed's order (the same decisions: "
                "the machine's speed, not the order) in " + "; ".join(noise)
            )
        if worse:
            measured += "; longer with a different schedule in " + "; ".join(worse)
        add("longest parked wait at or below the seed's order (real server, one run)", measured, not worse)
    pr = [r for r in rows("pressure-park-ram.md") if "ram=" in r["n_ctx"] and r["mode"] != "upstream"]
    if pr:
        add(
            "every request completes at --park-ram 1 (safety net alone, kvctl alone)",
            f"{sum(int(r['completed'].split('/')[0]) for r in pr)}/"
            f"{sum(int(r['completed'].split('/')[1]) for r in pr)} completed, "
            f"{sum(int(r['errors']) for r in pr)} errors",
            all(r["completed"].split("/")[0] == r["completed"].split("/")[1] and r["errors"] == "0" for r in pr),
        )
    pc = [r for r in rows("park_cost.md") if "recompute / prefill" in r]
    if pc:
        worst = max(float(r["recompute / prefill"]) for r in pc)
        add(
            "a recompute resume of N tokens costs about a prefill of N tokens (ratio ≤ 1.25)",
            ", ".join(f"{r['cells']} cells: {r['recompute / prefill']}" for r in pc),
            worst <= 1.25,
        )
    sp = [r for f in ("park_speed.md", "park_speed_1g.md") for r in rows(f) if r.get("--park-slice") != "0"]
    if sp:
        for fa in sorted({r["-fa"] for r in sp}):
            fr = [r for r in sp if r["-fa"] == fa]
            worst = min(min(float(r["park / memcpy"]), float(r["resume / memcpy"])) for r in fr)
            add(
                f"park and resume ≥ 80 % of memcpy, -fa {fa}, cells interleaved (issue 17's run, before patch 31)",
                ", ".join(f"{r['snapshot MiB']} MiB: {r['park / memcpy']} / {r['resume / memcpy']}" for r in fr),
                worst >= 0.8,
            )
            lay = [r for r in fr if "park / layout" in r]
            if lay:
                worst = min(min(float(r["park / layout"]), float(r["resume / layout"])) for r in lay)
                add(
                    f"park and resume ≥ 80 % of the same layout copied by numpy, -fa {fa} (issue 17's run, flat numpy)",
                    ", ".join(f"{r['snapshot MiB']} MiB: {r['park / layout']} / {r['resume / layout']}" for r in lay),
                    worst >= 0.8,
                )
        add(
            "the other streams' longest gap during a sliced park within their gap + 2 steps + 5 ms",
            ", ".join(f"{r['snapshot MiB']} MiB -fa {r['-fa']}: {r['gap max ms (park)']}/{r['bound ms']}" for r in sp),
            all(r["within bound"] == "yes" for r in sp),
        )
    # issue 35: every cache layout, contiguous against memcpy, interleaved against the layout, the stall bound
    contig = [r for c in ("f32", "f16", "q8_0") for r in rows(f"park_speed_contiguous_{c}.md")]
    for fa, cache in sorted({(r["-fa"], r["cache"]) for r in contig}):
        fr = [r for r in contig if (r["-fa"], r["cache"]) == (fa, cache)]
        worst = min(min(float(r["park / memcpy"]), float(r["resume / memcpy"])) for r in fr)
        add(
            f"park and resume ≥ 80 % of memcpy, -fa {fa}, {cache}, contiguous cells (issue 35)",
            ", ".join(f"{r['snapshot MiB']} MiB: {r['park / memcpy']} / {r['resume / memcpy']}" for r in fr),
            worst >= 0.8,
        )
        add(
            f"park and resume ≥ 80 % of the same layout's copy by numpy, -fa {fa}, {cache}, contiguous cells",
            ", ".join(
                f"{r['snapshot MiB']} MiB: {r['park / layout']} / {r['resume / layout']} "
                f"(numpy {r['same layout by numpy GB/s']} GB/s)"
                for r in fr
            ),
            min(min(float(r["park / layout"]), float(r["resume / layout"])) for r in fr) >= 0.8,
        )
    inter = rows("park_speed_stall_interleaved.md")
    for r in inter:
        add(
            f"park and resume ≥ 80 % of the same layout's gather, -fa {r['-fa']}, {r['cache']}, cells interleaved",
            f"{r['park GB/s']} / {r['resume GB/s']} GB/s against {r['same layout by numpy GB/s']} GB/s: "
            f"{r['park / layout']} / {r['resume / layout']}",
            min(float(r["park / layout"]), float(r["resume / layout"])) >= 0.8,
        )
    every = contig + inter
    if every:
        add(
            "the other streams' longest gap during a park or resume within 2 decode steps + 5 ms, every layout",
            ", ".join(
                f"-fa {r['-fa']} {r['cache']} {r['snapshot MiB']} MiB: {r['gap max ms (park)']}/{r['bound ms']}"
                for r in every
            ),
            all(r["within bound"] == "yes" for r in every),
        )
    rss = [r for f in ("park_speed.md", "park_speed_1g.md") for r in rows(f, 1) if r.get("--park-slice") != "0"]
    if rss:
        add(
            "RSS within 5 % of its pre-park level --park-arena-keep + 5 s after the last resume",
            ", ".join(f"{r['RSS before the last park MiB']} → {after_rss(r)} MiB" for r in rss),
            all(r["within 5 %"] == "yes" for r in rss),
        )
    sim = rows("policy_sim.md")
    if sim:
        bad = [
            f"longer in {r['n_ctx']} {r['workload']}: {r['max wait kvctl']} vs {r['max wait seed']} decode steps"
            for r in sim
            if int(r["max wait kvctl"]) > int(r["max wait seed"])
        ]
        add(
            "longest parked wait at or below the seed's order (simulated, exact)",
            "; ".join(bad) or f"all {len(sim)} workloads",
            not bad,
        )
    o = [r for r in rows("overhead.md") if "loss, 95 % upper bound %" in r]  # tables of this version
    for r in o:
        if r["comparison"].startswith("(a)"):
            add(
                f"(a) throughput loss ≤ 0.6 %, {r['streams']} stream(s)",
                f"{r['loss %']} % (95 % upper bound {r['loss, 95 % upper bound %']} %)",
                float(r["loss, 95 % upper bound %"]) <= 0.6,
            )
        elif r["comparison"].startswith("(b) kvctl stack"):
            add(
                f"(b) whole stack, aim ≤ 0.6 %, {r['streams']} stream(s)",
                f"{r['loss %']} % (95 % upper bound {r['loss, 95 % upper bound %']} %)",
                None,
            )
    ex = [r for r in rows("exactness.md") if r["streams"] == "1"]
    if ex:
        add(
            "solo exactness with ≥ 10 forced parks per 1000-token stream",
            ", ".join(
                f"{r['model']}: {r['forced parks']} parks, same bytes {r['same bytes']}, same ids {r['same token ids']}"
                for r in ex
            ),
            all(int(r["forced parks"]) >= 10 and r["same bytes"] == r["same token ids"] == "True" for r in ex),
        )
    ps = [r for r in rows("policy_scale.md") if r["slots"] == "256"]
    if ps:
        add(
            "policy decision under 1 ms at 256 slots",
            f"p50 {ps[0]['decision p50 ms']} ms, p99 {ps[0]['p99 ms']} ms",
            float(ps[0]["p99 ms"]) < 1,
        )
    return "\n".join(out)


def main() -> int:
    parts = [
        "# kvctl benchmark results",
        "",
        f"Machine: {machine()}.",
        "",
        "Shared 2-core machines are noisy: read ratios and paired comparisons, not absolute times. The "
        "models are random-weight GGUFs the scripts generate (`tiny`: 64-dim, 2 layers; `bench`: 512-dim, "
        "2 layers, ~10 ms/token on one core; `qwen35`: the hybrid model with an MTP layer).",
        "",
    ]
    parts += ["## Floors", "", floors(), ""]
    for name, title, cmd, what in SECTIONS:
        path = RESULTS / name
        parts += [f"## {title}", "", f"Command: `{cmd}`", "", what, ""]
        missing = "_not run: no GPU was lent to the sessions so far_" if name.startswith("gpu-") else "_not run yet_"
        parts += [path.read_text().strip() if path.exists() else missing, ""]
        png = path.with_suffix(".png")
        if png.exists():
            parts += [f"![{title}](results/{png.name})", ""]
    (ROOT / "bench" / "RESULTS.md").write_text("\n".join(parts))
    print(ROOT / "bench" / "RESULTS.md")
    return 0


if __name__ == "__main__":
    cli(main)
