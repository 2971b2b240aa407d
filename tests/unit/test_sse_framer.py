"""Property tests of the SSE framer: any split of the byte stream gives the same events."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from controller.proxy.sse import SSEFramer, comment_text, has_data, is_comment

# payloads with the characters that break naive framers: U+2028/2029/0085 inside JSON strings
TEXT = st.text(alphabet=st.sampled_from(list('ab {}":,\u2028\u2029\u0085é€😀')), max_size=20)
TERM = st.sampled_from(["\n", "\r\n", "\r"])


@st.composite
def events(draw: st.DrawFn) -> list[bytes]:
    out = []
    for _ in range(draw(st.integers(1, 6))):
        term = draw(TERM)
        kind = draw(st.sampled_from(["data", "comment", "multi"]))
        if kind == "data":
            body = f'data: {{"content": "{draw(TEXT)}"}}{term}'
        elif kind == "comment":
            body = f": {draw(st.sampled_from(['parked', 'resumed', 'keep-alive', '']))}{term}"
        else:
            body = f"event: x{term}data: {draw(TEXT)}{term}data: {draw(TEXT)}{term}"
        out.append((body + term).encode())
    return out


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    parts, prev = [], 0
    for p in points:
        parts.append(data[prev:p])
        prev = p
    parts.append(data[prev:])
    return parts


@given(events(), st.lists(st.integers(0, 10_000), max_size=12))
def test_any_split_gives_the_same_events(evs: list[bytes], cuts: list[int]) -> None:
    stream = b"".join(evs)
    framer = SSEFramer()
    got: list[bytes] = []
    for part in split(stream, cuts):
        got.extend(framer.feed(part))
    rest = framer.flush()
    if rest:
        got.append(rest)
    assert b"".join(got) == stream, "bytes must pass unchanged"
    # a trailing lone CR is held until end of stream; every other event comes out whole
    assert got == evs


@given(events(), st.lists(st.integers(0, 10_000), max_size=12))
def test_a_heartbeat_never_lands_inside_an_event(evs: list[bytes], cuts: list[int]) -> None:
    """The relay writes a heartbeat only when nothing is pending: the output stays a valid event sequence."""
    framer = SSEFramer()
    out: list[bytes] = []
    hb = b": kvctl keep-alive\n\n"
    for part in split(b"".join(evs), cuts):
        out.extend(framer.feed(part))
        if not framer.pending:
            out.append(hb)
    out.append(framer.flush())
    reframed = SSEFramer()
    again = [*reframed.feed(b"".join(out)), reframed.flush()]
    assert [e for e in again if e and e != hb] == evs


def test_comment_helpers() -> None:
    assert is_comment(b": parked\n\n") and comment_text(b": parked\n\n") == "parked"
    assert not is_comment(b"data: {}\n\n") and has_data(b"data: {}\n\n")
    assert is_comment(b":\n\n") and not has_data(b":\n\n")
