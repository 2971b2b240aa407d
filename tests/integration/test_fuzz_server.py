"""Garbage at the patched endpoints: every request gets a clear 4xx/5xx in the server's error
shape, and the server keeps serving (hypothesis drives the inputs)."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from testkit.llama import ServerProcess


@pytest.fixture(scope="module")
def server(llama_server_bin: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("fuzz") / "server.log"
    srv = ServerProcess(llama_server_bin, tiny_model, ("-c", "1024", "-np", "2", "-kvu", "--slots"), log).start()
    yield srv.url
    alive = srv.proc is not None and srv.proc.poll() is None
    srv.stop()
    assert alive, "the server died under fuzzing:\n" + srv.log_tail()


def call(method: str, url: str, body: bytes | None = None, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


SLOT_IDS = st.one_of(
    st.integers(-(2**40), 2**40).map(str),
    st.text(alphabet=st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=12),
    st.sampled_from(["0", "1", "2", "007", "1e3", "0x1", " 1", "1 ", "+1", "-0", "9" * 30]),
)
ACTIONS = st.one_of(
    st.sampled_from(["park", "resume", "save", "restore", "erase", "PARK", "", "park;x"]), st.text(max_size=10)
)
BODIES = st.one_of(
    st.none(),
    st.binary(max_size=64),
    st.sampled_from(
        [
            b"{}",
            b"[]",
            b"null",
            b'{"id_task": null}',
            b'{"id_task": "1"}',
            b'{"id_task": 1e99}',
            b'{"id_task": -1}',
            b'{"id_task": 18446744073709551616}',
            b'{"id_task": true}',
        ]
    ),
    st.dictionaries(st.text(max_size=8), st.one_of(st.integers(), st.text(max_size=8), st.none()), max_size=3).map(
        lambda d: json.dumps(d).encode()
    ),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(slot=SLOT_IDS, action=ACTIONS, body=BODIES)
def test_slot_actions_with_garbage_get_clear_errors(server: str, slot: str, action: str, body: bytes | None) -> None:
    url = f"{server}/slots/{urllib.parse.quote(slot, safe='')}?action={urllib.parse.quote(action, safe='')}"
    status, raw = call("POST", url, body)
    # nothing runs on an idle server, so nothing can succeed
    assert status in (400, 404, 409, 501), (status, raw[:200])
    err = json.loads(raw)["error"]
    assert err["code"] == status and err["message"] and err["type"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    path=st.sampled_from(["/kv", "/slots", "/metrics"]),
    query=st.text(max_size=20),
    lease=st.sampled_from([None, "1", "0", "yes", "\t1"]),
)
def test_reads_with_garbage_queries_and_headers(server: str, path: str, query: str, lease: str | None) -> None:
    headers = {"X-Park-Lease": lease} if lease is not None else {}
    status, raw = call("GET", f"{server}{path}?{urllib.parse.quote(query)}", headers=headers)
    assert status in (200, 501), (status, raw[:200])
    if path == "/kv":
        kv = json.loads(raw)
        assert kv["n_cells_used"] + kv["n_cells_free"] == kv["n_cells"]


def test_server_still_serves(server: str) -> None:
    status, raw = call("POST", server + "/completion", json.dumps({"prompt": "still alive", "n_predict": 8}).encode())
    assert status == 200 and json.loads(raw)["tokens_predicted"] == 8
