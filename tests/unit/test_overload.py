"""bench.overload's own arithmetic: the request set, the loads, reading aiperf's records, and its pinned tools."""

from __future__ import annotations

import math
import re
import statistics
from pathlib import Path

import pytest

from bench.overload.__main__ import N_CTX, Chat, analyse, classify, finite, holds, plan, request_set, server_counts
from bench.overload.tools import HERE, LITELLM_CONFIG

CUT = {"type": "InvalidInferenceResultError", "message": "No responses with actual content"}


def test_request_set_is_seeded_log_normal_and_clipped() -> None:
    chats = request_set(256, 7)
    assert chats == request_set(256, 7) and chats != request_set(256, 8)
    prompts, answers = [c.input_length for c in chats], [c.output_length for c in chats]
    assert all(24 <= p <= 512 for p in prompts) and all(16 <= a <= 256 for a in answers)
    assert 130 < statistics.median(prompts) < 190 and 80 < statistics.median(answers) < 115
    # log-normal: skewed to the right, the mean above the median
    assert statistics.fmean(prompts) > statistics.median(prompts)


def test_one_x_is_the_most_consecutive_chats_the_pool_holds() -> None:
    chats = request_set(64, 3)
    n = holds(chats)
    windows = [sum(c.cells for c in chats[i : i + n]) for i in range(len(chats) - n + 1)]
    assert max(windows) <= N_CTX
    assert max(sum(c.cells for c in chats[i : i + n + 1]) for i in range(len(chats) - n)) > N_CTX
    assert holds([Chat(10, 10)] * 8) == 8  # all of them fit: never more than there are


def test_loads_scale_concurrency_and_send_enough_requests_to_overflow() -> None:
    loads, n_slots = plan(8, [1, 2, 4], [0.5, 2], 4)
    by = {ld.name: ld for ld in loads}
    assert [by[k].concurrency for k in ("1x", "2x", "4x")] == [4, 8, 16]
    assert n_slots == 16
    assert all(by[k].count >= 2 * by[k].concurrency for k in ("1x", "2x", "4x"))
    assert by["0.5/s"].rate == 0.5 and by["2/s"].concurrency == n_slots


def record(
    tokens: int | None, ttft_ms: float = 500, e2e_ms: float = 4000, error: dict[str, object] | None = None
) -> dict[str, object]:
    metrics: dict[str, object] = {
        "time_to_first_token": {"value": ttft_ms},
        "request_latency": {"value": e2e_ms},
        "inter_chunk_latency": {"value": [40.0, 50.0]},
    }
    if tokens is not None:
        metrics["usage_completion_tokens"] = {"value": tokens}
    meta = {"request_start_ns": 0, "request_end_ns": int(e2e_ms * 1e6)}
    return {"metadata": meta, "metrics": metrics, "error": error}


def test_a_request_completes_only_when_its_stream_ends_with_the_answer() -> None:
    records = [
        record(100),
        record(50, ttft_ms=20_000, e2e_ms=10_000),  # completed, outside the TTFT SLO: not in goodput
        record(None),  # 200, the SSE error event instead of the answer: aiperf sees no error
        record(None, error=CUT),  # the same before the first token
        record(None, error={"type": "ClientResponseError", "code": 503, "message": "Service Unavailable"}),
        record(None, error={"type": "TimeoutError", "message": "timed out"}),
    ]
    run = analyse(records, "upstream", "2x", wasted=400, counts=(6, 3, 3))
    assert (run.sent, run.completed, run.within_slo) == (6, 2, 1)
    assert run.errors == {"stream_cut": 2, "5xx": 1, "timeout": 1}
    assert run.goodput_tok_s == pytest.approx(100 / 10.0)  # the one within the SLO, over the run's 10 s
    assert run.wasted_tokens == 400 - 150  # generated, minus what completed requests received
    assert run.ttft_p50_s == pytest.approx(10.25) and run.itl_p99_s == pytest.approx(0.0499, abs=1e-3)
    assert run.retries_saved is None  # only a gateway retries


def test_retries_saved_counts_failed_attempts_that_did_not_reach_a_client() -> None:
    # LiteLLM retried 2 of the 3 attempts the server failed, and those retries completed: 1 client failure
    records = [record(80)] * 9 + [record(None)]
    run = analyse(records, "litellm", "2x", wasted=0, counts=(12, 3, 3))
    assert run.retries_saved == 2
    # a failure mid-stream cannot be retried: attempts == requests, nothing saved
    assert analyse(records, "litellm", "2x", wasted=0, counts=(10, 1, 1)).retries_saved == 0
    # retries that all failed again save nothing, however many there were
    assert analyse([record(None)] * 4, "litellm", "4x", wasted=0, counts=(7, 7, 7)).retries_saved == 0


def test_errors_are_classified_by_kind() -> None:
    assert classify({"type": "X", "message": "Context size has been exceeded."}) == "context_exceeded"
    assert classify({"type": "ClientResponseError", "code": 502}) == "5xx"
    assert classify({"type": "ClientResponseError", "code": 429}) == "429"
    assert classify({"type": "asyncio.TimeoutError", "message": ""}) == "timeout"
    assert classify({"type": "ServerDisconnectedError", "message": ""}) == "ServerDisconnectedError"


def test_server_log_counts_attempts_and_overflow_failures(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text(
        "slot launch_slot_: id  1 | task 0 | processing task, is_child = 0\n"
        "slot launch_slot_: id  2 | task 3 | processing task, is_child = 0\n"
        "srv    send_error: task id = 3, error: Context size has been exceeded.\n"
        "srv    send_error: task id = 9, error: the request exceeds the available context size\n"
    )
    assert server_counts(log) == (2, 2, 1)


def test_results_json_has_no_nan() -> None:
    assert finite({"a": math.nan, "b": [1.0, math.nan], "c": {"d": 2}}) == {"a": None, "b": [1.0, None], "c": {"d": 2}}


@pytest.mark.parametrize("name", ["aiperf", "litellm"])
def test_third_party_tools_are_pinned_with_hashes(name: str) -> None:
    """pip installs them with --require-hashes: every requirement an exact version with its hashes."""
    text = (HERE / f"requirements-{name}.txt").read_text()
    reqs = [r for r in re.split(r"(?m)^(?=[A-Za-z0-9])", text) if r.strip() and not r.startswith("#")]
    assert len(reqs) > 20
    for r in reqs:
        assert re.match(r"^[A-Za-z0-9_.\-\[\]]+==[^\s\\]+", r), r[:80]
        assert "--hash=sha256:" in r, r[:80]
    assert f"\n{name}==" in "\n" + text or text.startswith(f"{name}==")


def test_litellm_is_not_a_compromised_release_and_checks_no_health_through_a_slot() -> None:
    text = (HERE / "requirements-litellm.txt").read_text()
    version = re.search(r"(?m)^litellm==(\S+)", text)
    assert version and version.group(1) not in ("1.82.7", "1.82.8")
    # LiteLLM's health checks are completions, each taking a server slot: they stay off
    assert "background_health_checks: false" in LITELLM_CONFIG
