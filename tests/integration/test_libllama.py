"""The series' libllama changes, by its own upstream-style tests (tests/test-*.cpp of the patches), which
scripts/build_llama.sh builds beside the server.

tests/test-memory-occupancy.cpp (patch 2): the pool's exact occupancy, shared cells counted once, a cell leaving
the count with its last sequence, cell_size bytes a cell in a sequence's state.

tests/test-state-seq-copy.cpp (patches 19, 30, 31, 41) saves a sequence whose cells
are partly contiguous and partly interleaved with two others' in steps into memory in pieces, and loads it back
into a fragmented cache, against the one-shot llama_state_seq_get_data(): the same bytes for any piece and step
size, on one thread and on two (steps of 1 MiB or more split between them), the same logits after the load,
no cells left by an unfinished load. Run here for every cache layout a
park copies: -fa on and off (V stored transposed), f32, f16 and q8_0 caches, on the real models (a llama and
an iSWA model) and on a random model of many small layers.

tests/test-mul-mat-width.cpp (patch 44): in the CPU backend's reference mode (what `--exact` runs), column 0 of a
matmul of 2-17 columns equals the column multiplied alone, bit for bit, for 11 weight types, 6 shapes, 1 and 2
threads (the default path fails it for f32, f16, bf16, IQ4_NL, Q4_K and Q6_K: it picks kernels by width).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from testkit import models, realmodels

pytestmark = pytest.mark.server

LAYOUTS = {
    "fa-on-f16": ["-fa", "on"],
    "fa-off-f16": ["-fa", "off"],
    "fa-on-q8_0": ["-fa", "on", "-ctk", "q8_0", "-ctv", "q8_0"],
    "fa-off-f32": ["-fa", "off", "-ctk", "f32", "-ctv", "f32"],
}


def series_test(llama_server_bin: Path, name: str) -> Path:
    path = llama_server_bin.parent / name
    assert path.is_file(), f"scripts/build_llama.sh builds {name} beside the server: {path} is missing"
    return path


def run(argv: list[str]) -> str:
    res = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    report = "\n".join(line for line in res.stderr.splitlines() if line.startswith(("main :", "FAILED")))
    assert res.returncode == 0, f"{' '.join(argv)}\n{report or res.stderr[-3000:]}"
    return report


@pytest.fixture(scope="module")
def kv64_model(models_dir: Path, vocab_dir: Path) -> Path:
    return models.write_llama(models_dir / "kv64.gguf", vocab_dir / "ggml-vocab-llama-spm.gguf", models.SIZES["kv64"])


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("which", ["smollm2", "gemma3", "kv64"])
def test_stepwise_copy_matches_the_one_shot_state(
    llama_server_bin: Path, kv64_model: Path, which: str, layout: str
) -> None:
    gguf = kv64_model if which == "kv64" else realmodels.model_path(which)
    test = series_test(llama_server_bin, "test-state-seq-copy")
    report = run([str(test), "-m", str(gguf), "-t", "1", *LAYOUTS[layout]])
    assert "saves in steps and pieces match the one-shot state" in report
    assert "loads in steps and pieces restore the same state (logits max diff 0)" in report


# plain KV caches: an iSWA or hybrid memory's state holds more than its base pool's cells
@pytest.mark.parametrize("layout", ["fa-on-f16", "fa-on-q8_0"])
@pytest.mark.parametrize("which", ["smollm2", "kv64"])
def test_occupancy_counts_each_cell_once(llama_server_bin: Path, kv64_model: Path, which: str, layout: str) -> None:
    gguf = kv64_model if which == "kv64" else realmodels.model_path(which)
    test = series_test(llama_server_bin, "test-memory-occupancy")
    assert "SUCCESS" in run([str(test), "-m", str(gguf), "-t", "1", *LAYOUTS[layout]])


def test_the_reference_matmul_sums_a_column_alike_at_every_width(llama_server_bin: Path) -> None:
    test = series_test(llama_server_bin, "test-mul-mat-width")
    res = subprocess.run([str(test)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.rstrip().endswith("OK"), res.stdout[-3000:] + res.stderr[-2000:]
