"""The framing every ``text/event-stream`` API shares, whatever its events mean: the
blocks of a stream, each block's event name and data, and the offsets of its data lines."""

from __future__ import annotations

from collections.abc import Iterator


def sse_events(text: str) -> Iterator[tuple[str, str]]:
    """(event, data) pairs of a ``text/event-stream`` text: the framing every SSE API
    shares, whatever its events mean."""
    for block in sse_blocks(text):
        found = sse_event(block)
        if found is not None:
            yield found


def sse_blocks(text: str) -> list[str]:
    """The blocks of a ``text/event-stream`` text, each an event (or none: a comment, a
    retry), for :func:`sse_event`: a reader after a few events may look for their text
    in a block before it reads the block."""
    return text.replace("\r\n", "\n").split("\n\n")


def sse_event(block: str) -> tuple[str, str] | None:
    """The (event, data) pair of one of :func:`sse_blocks`, None when it has no data."""
    lines = block.split("\n")
    if len(lines) == 2:  # the usual block, an event line and a data line: read at once
        first, second = lines
        if first.startswith("event:") and second.startswith("data:"):
            return first[6:].strip(), second[5:].lstrip(" ")
    event, data = "message", []
    for line in lines:
        if line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip(" "))
    return (event, "\n".join(data)) if data else None


def data_lines(body: bytes) -> Iterator[tuple[int, bytes]]:
    """(offset, payload) of each ``data:`` line of an event stream's raw bytes."""
    pos = 0
    for line in body.splitlines(keepends=True):
        if line.startswith(b"data:"):
            start = 5 + (1 if line[5:6] == b" " else 0)
            yield pos + start, line[start:].rstrip(b"\r\n")
        pos += len(line)
