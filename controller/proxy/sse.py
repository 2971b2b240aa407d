"""SSE framing for the relay: complete events only, the server's bytes untouched.

An event ends at a blank line. Lines end at CRLF, LF or CR (the SSE spec), never at the
Unicode line separators that str.splitlines() also honours: random-weight models emit U+2028
inside JSON strings, and llama-server does not escape it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator


class SSEFramer:
    """Feed bytes as they arrive; get back complete events, each with its terminating blank line.

    A CR at the very end of the buffer is ambiguous (it may be the first half of a CRLF), so
    the scan stops there until the next byte or the end of the stream.
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self._scan = 0  # where the next line starts: bytes before it are complete lines

    @property
    def pending(self) -> bool:
        """Whether part of an event is buffered: a heartbeat now would land inside it."""
        return bool(self._buf)

    def feed(self, data: bytes) -> Iterator[bytes]:
        self._buf += data
        buf = self._buf
        while True:
            cr, lf = buf.find(b"\r", self._scan), buf.find(b"\n", self._scan)
            if cr < 0 and lf < 0:
                return
            pos = lf if cr < 0 or (0 <= lf < cr) else cr
            if buf[pos] == 0x0D:  # CR: alone, or the first half of CRLF
                if pos + 1 == len(buf):
                    return  # wait: the LF may be in the next chunk
                term_end = pos + 2 if buf[pos + 1] == 0x0A else pos + 1
            else:
                term_end = pos + 1
            blank = pos == self._scan
            self._scan = term_end
            if blank:
                # an empty line ends the event (a stray one alone is passed through as it is)
                event = bytes(buf[:term_end])
                del buf[:term_end]
                self._scan = 0
                yield event

    def flush(self) -> bytes:
        """End of stream: whatever is left (an event the server never terminated)."""
        rest = bytes(self._buf)
        self._buf.clear()
        self._scan = 0
        return rest


_LINE_END = re.compile(rb"(\r\n|\n|\r)")


def split_lines(event: bytes) -> list[bytes]:
    """An event's lines with their ends between them (``[line, end, line, end, ..., rest]``), so that joining the
    parts gives back the event byte for byte."""
    return _LINE_END.split(event)


def lines(event: bytes) -> list[bytes]:
    """An event's lines without their ends (CRLF, LF or CR)."""
    return split_lines(event)[::2]


def first_data(event: bytes) -> bytes | None:
    """What follows ``data:`` on the event's first data line, as sent; None without one."""
    line = next((ln for ln in lines(event) if ln.startswith(b"data:")), None)
    return line[5:] if line is not None else None


def replace_first_data(event: bytes, line: bytes) -> bytes:
    """The event with its first data line replaced by ``line``; every other byte, line ends included, as it was."""
    parts = split_lines(event)
    at = next((i for i in range(0, len(parts), 2) if parts[i].startswith(b"data:")), None)
    if at is None:
        return event
    parts[at] = line
    return b"".join(parts)


def is_comment(event: bytes) -> bool:
    """An event made only of comment lines (heartbeats, ': parked', ': resumed')."""
    present = [ln for ln in lines(event) if ln]
    return bool(present) and all(ln.startswith(b":") for ln in present)


def comment_text(event: bytes) -> str:
    return lines(event)[0].lstrip(b":").strip().decode("utf-8", "replace")


def has_data(event: bytes) -> bool:
    return any(ln.startswith(b"data:") for ln in lines(event))
