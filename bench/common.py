"""Shared pieces of the benchmarks: servers, models, clients, statistics, tables.

Benchmarks print markdown tables and write PNG plots into bench/results/. Absolute times on
shared 2-core machines are noisy: report ratios and paired comparisons.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT))

from testkit import models, realmodels  # noqa: E402
from testkit.llama import ServerProcess  # noqa: E402


def build(patched: bool = True) -> Path:
    """The cached server build; KVCTL_BENCH_BUILD_ARGS adds build flags (bench/gpu.sh: '--cuda').
    KVCTL_BENCH_SERVER names a patched binary to use instead (a maintainer's work tree; vocab/ beside its bin/)."""
    if patched and os.environ.get("KVCTL_BENCH_SERVER"):
        return Path(os.environ["KVCTL_BENCH_SERVER"])
    extra = os.environ.get("KVCTL_BENCH_BUILD_ARGS", "").split()
    args = ["bash", str(ROOT / "scripts" / "build_llama.sh"), *extra] + ([] if patched else ["--no-patches"])
    out = subprocess.run(args, check=True, stdout=subprocess.PIPE, text=True).stdout
    return Path(out.strip().splitlines()[-1])


def vocab_dir(binary: Path) -> Path:
    return binary.parent.parent / "vocab"


def model(kind: str, binary: Path) -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvctl" / "models"
    cache.mkdir(parents=True, exist_ok=True)
    v = vocab_dir(binary)
    if kind in realmodels.MODELS:
        return realmodels.model_path(kind)  # trained weights from their packages (testkit.realmodels)
    if kind == "qwen35":
        return models.write_qwen35(cache / "bench-qwen35-mtp.gguf", v / "ggml-vocab-qwen35.gguf")
    return models.write_llama(cache / f"bench-{kind}.gguf", v / "ggml-vocab-llama-spm.gguf", models.SIZES[kind])


@contextlib.contextmanager
def server(binary: Path, gguf: Path, *args: str, cpus: set[int] | None = None) -> Iterator[ServerProcess]:
    log = Path(tempfile.mkstemp(prefix="kvctl-bench-", suffix=".log")[1])
    srv = ServerProcess(binary, gguf, args, log, cpus=cpus)
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
    return m, t95(n - 1) * statistics.stdev(values) / math.sqrt(n)


# two-sided 95 % quantiles of Student's t by degrees of freedom
_T95 = [12.71, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131]
_T95 += [2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def t95(df: int) -> float:
    if df <= len(_T95):
        return _T95[df - 1]
    return 2.021 if df <= 40 else 2.000 if df <= 60 else 1.980 if df <= 120 else 1.960


def placement(pin: bool) -> tuple[set[int] | None, set[int] | None]:
    """CPUs for the server(s) and for everything else (clients, kvctl); (None, None) when not pinned.

    On 2 cores, the server's compute thread gets a core to itself, so a client or a proxy busy
    on the other core does not steal its time slices (which would measure the machine, not kvctl).
    """
    cpus = sorted(os.sched_getaffinity(0))
    if not pin or len(cpus) < 2:
        return None, None
    half = max(1, len(cpus) // 2)
    return set(cpus[:half]), set(cpus[half:])


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


def cli(main: Callable[[], int | None]) -> NoReturn:
    """Run a benchmark's main. SIGTERM (``timeout``, a CI runner's cancel) exits like Ctrl-C, through every
    ``with``: the servers and kvctl stacks the benchmark started are stopped, not left running as orphans that
    spin on the cores the next measurement needs."""

    def stop(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    sys.exit(main())
