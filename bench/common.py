"""Shared pieces of the benchmarks: servers, models, clients, statistics, tables.

Benchmarks print markdown tables and write PNG plots into bench/results/. Absolute times on
shared 2-core machines are noisy: report ratios and paired comparisons.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT))

from controller import testmodels  # noqa: E402
from tests.integration.llama import ServerProcess  # noqa: E402


def build(patched: bool = True) -> Path:
    args = ["bash", str(ROOT / "scripts" / "build_llama.sh")] + ([] if patched else ["--no-patches"])
    out = subprocess.run(args, check=True, stdout=subprocess.PIPE, text=True).stdout
    return Path(out.strip().splitlines()[-1])


def vocab_dir(binary: Path) -> Path:
    return binary.parent.parent / "vocab"


def model(kind: str, binary: Path) -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvctl" / "models"
    cache.mkdir(parents=True, exist_ok=True)
    v = vocab_dir(binary)
    if kind == "qwen35":
        return testmodels.write_qwen35(cache / "bench-qwen35-mtp.gguf", v / "ggml-vocab-qwen35.gguf")
    return testmodels.write_llama(cache / f"bench-{kind}.gguf", v / "ggml-vocab-llama-spm.gguf", testmodels.SIZES[kind])


@contextlib.contextmanager
def server(binary: Path, gguf: Path, *args: str) -> Iterator[ServerProcess]:
    log = Path(tempfile.mkstemp(prefix="kvctl-bench-", suffix=".log")[1])
    srv = ServerProcess(binary, gguf, args, log)
    try:
        yield srv.start()
    finally:
        srv.stop()


def pct(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def mean_ci(values: Sequence[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95 % confidence interval (t distribution)."""
    n = len(values)
    m = statistics.fmean(values)
    if n < 2:
        return m, math.nan
    t = {2: 12.71, 3: 4.30, 4: 3.18, 5: 2.78, 6: 2.57, 7: 2.45, 8: 2.36, 9: 2.31, 10: 2.26}.get(n, 2.2)
    return m, t * statistics.stdev(values) / math.sqrt(n)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return "n/a" if math.isnan(v) else f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def save(name: str, text: str) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / name
    path.write_text(text)
    return path
