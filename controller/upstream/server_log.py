"""A spawned server's output: where it goes, and its last lines, kept for ``/status`` and the ``supervisor.failed``
log line when it dies.

With ``supervisor.log_file`` the server writes the file itself, as it always did, and the lines it appended are
read back from the file after it exits: the server never waits for kvctl to log. Without, its stdout and stderr
(kvctl's own, before) are pipes that kvctl copies to its own stdout and stderr as the bytes arrive, keeping the last
lines on the way. The pipes are not asyncio's subprocess pipes: those make ``Process.wait()`` wait for every
holder of the pipe to close it, and a helper the server started may hold it after the server died.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import os
import re
from pathlib import Path
from typing import IO

__all__ = ["TAIL_LINES", "ServerOutput", "Tail"]

TAIL_LINES = 20
"""Lines kept: a crash's message and the lines before it, not a log."""
LINE_MAX_CHARS = 500
"""A longer line (a prompt printed with -v) is cut, so the tail stays small in /status."""
_FILE_READ_BYTES = 64 * 1024
"""How far back the tail is read from a log file: 20 lines of at most 500 characters fit with room to spare."""
_COPY_CHUNK = 64 * 1024
_DRAIN_S = 1.0
"""After the server's group is killed, how long the copies wait for the pipes' end: a process that left the group
may hold them open."""


_ESCAPES = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")  # colours and cursor moves (CSI sequences)
_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def _text(line: bytes) -> str:
    """A line as shown: what a terminal would act on (colours, a carriage return) is not kept."""
    text = _CONTROLS.sub("", _ESCAPES.sub("", line.decode("utf-8", errors="replace"))).rstrip()
    return text if len(text) <= LINE_MAX_CHARS else text[: LINE_MAX_CHARS - 1] + "\u2026"


class Tail:
    """The last ``lines`` lines of one or more byte streams, each stream's partial line held apart until it ends."""

    def __init__(self, lines: int = TAIL_LINES) -> None:
        self._max = lines
        self._lines: collections.deque[str] = collections.deque(maxlen=lines)
        self._partial: dict[int, bytearray] = {}

    def feed(self, data: bytes, stream: int = 0) -> None:
        partial = self._partial.setdefault(stream, bytearray())
        *complete, rest = data.split(b"\n")
        for piece in complete:
            partial += piece
            self._lines.append(_text(bytes(partial)))
            partial.clear()
        # a line without an end (a progress bar) must not grow without bound: what is past the cut is not shown
        partial += rest[: max(0, LINE_MAX_CHARS * 4 - len(partial))]

    def lines(self) -> list[str]:
        """The kept lines, each stream's unfinished one last."""
        out = [*self._lines, *(_text(bytes(p)) for p in self._partial.values() if p)]
        return out[len(out) - self._max :] if len(out) > self._max else out


def _close(pipe: IO[bytes], _: object) -> None:
    pipe.close()


def _write_all(fd: int, data: bytes) -> bool:
    """False once ``fd`` takes no more (closed, a reader gone): the rest is dropped, as it would be for the server."""
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view) :]
    except OSError:
        return False
    return True


class ServerOutput:
    """One run's output: ``stdout`` and ``stderr`` are what the server is started with; ``spawned()`` after the
    start (or its failure), ``finish()`` after the server's group is gone gives the last lines."""

    def __init__(self, log_file: Path | None, lines: int = TAIL_LINES) -> None:
        self._tail = Tail(lines)
        self._copies: list[asyncio.Task[None]] = []
        self._reader: IO[bytes] | None = None
        self._offset = 0
        self._child: list[int | IO[bytes]] = []  # the server's ends: closed in kvctl once it has them
        self._pipes: list[tuple[int, int]] = []  # (the read end, kvctl's fd to copy to)
        self.stdout: int | IO[bytes]
        self.stderr: int | None
        if log_file is not None:
            target = log_file.open("ab")
            try:
                # read through a handle of its own: it follows the file the server writes even when logrotate
                # renames it meanwhile
                self._reader = log_file.open("rb")
            except OSError:
                target.close()
                raise
            self._offset = os.fstat(self._reader.fileno()).st_size
            self._child.append(target)
            self.stdout, self.stderr = target, asyncio.subprocess.STDOUT
            return
        writes = []
        try:
            for own in (1, 2):
                read, write = os.pipe()
                self._pipes.append((read, own))
                writes.append(write)
                self._child.append(write)
        except OSError:  # out of file descriptors
            self.close()
            raise
        self.stdout, self.stderr = writes[0], writes[1]

    @classmethod
    def adopted(cls, log_file: Path | None, read_ends: list[int], lines: int = TAIL_LINES) -> ServerOutput:
        """The output of a server a previous kvctl worker started (under the keeper): its log file from here on, or
        the read ends of its pipes, which the keeper kept open."""
        if log_file is not None:
            for fd in read_ends:
                os.close(fd)
            return cls(log_file, lines)
        out = cls.__new__(cls)
        out._tail, out._copies, out._reader, out._offset, out._child = Tail(lines), [], None, 0, []
        out._pipes = list(zip(read_ends, (1, 2), strict=False))
        out.stdout, out.stderr = 1, 2
        return out

    def read_ends(self) -> list[int]:
        """The pipes' read ends (before spawned()): the keeper keeps copies, so that the server's writes never meet
        a closed pipe while no worker reads them."""
        return [read for read, _ in self._pipes]

    def _close_child_ends(self) -> None:
        for end in self._child:
            if isinstance(end, int):
                os.close(end)
            else:
                end.close()
        self._child.clear()

    def spawned(self) -> None:
        """The server has its ends now (or it did not start): close them here, and start copying."""
        self._close_child_ends()
        for i, (read, own) in enumerate(self._pipes):
            pipe = os.fdopen(read, "rb", buffering=0)
            task = asyncio.create_task(self._copy(pipe, own, i), name=f"server output {own}")
            # closed however the copy ends, even cancelled before it began (closing twice is a no-op)
            task.add_done_callback(functools.partial(_close, pipe))
            self._copies.append(task)
        self._pipes.clear()

    async def _copy(self, pipe: IO[bytes], own: int, stream: int) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=_COPY_CHUNK)
        transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
        writable = True
        try:
            while chunk := await reader.read(_COPY_CHUNK):
                self._tail.feed(chunk, stream)
                # kvctl's own stdout and stderr, written off the event loop: a reader that falls behind (a full
                # pipe) slows the server's writes, as it did before kvctl relayed them, never kvctl's proxy
                writable = writable and await asyncio.to_thread(_write_all, own, chunk)
        finally:
            transport.close()

    async def finish(self) -> list[str]:
        """The last lines the server wrote in this run."""
        if self._copies:
            _, pending = await asyncio.wait(self._copies, timeout=_DRAIN_S)
            for task in pending:
                task.cancel()
            for task in self._copies:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            self._copies.clear()
        if self._reader is not None:
            self._feed_from_file(self._reader)
            self._reader.close()
            self._reader = None
        return self._tail.lines()

    def _feed_from_file(self, f: IO[bytes]) -> None:
        with contextlib.suppress(OSError):
            size = os.fstat(f.fileno()).st_size
            start = self._offset if size >= self._offset else 0  # truncated meanwhile (copytruncate): all there is
            cut = max(start, size - _FILE_READ_BYTES)
            f.seek(cut)
            data = f.read(size - cut)
            if cut > start:
                data = data.partition(b"\n")[2]  # the first line began before what was read
            self._tail.feed(data)

    def close(self) -> None:
        """Let go of everything without reading the tail (cancelled): a copy ends at its next step."""
        for task in self._copies:
            task.cancel()
        self._copies.clear()
        for read, _ in self._pipes:
            os.close(read)
        self._pipes.clear()
        self._close_child_ends()
        if self._reader is not None:
            self._reader.close()
            self._reader = None
