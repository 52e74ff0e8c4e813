"""Gemini's response stream: assemble it into one response, or synthesise one.

The stream codec of :class:`recorder.providers.gemini.GeminiFormat`; readers go through
the provider (``assemble``, ``synthesize``, ``message``).

``POST .../models/{model}:streamGenerateContent?alt=sse`` answers ``data: {chunk}`` lines
(``\\r\\n\\r\\n`` between them), each chunk a whole ``GenerateContentResponse`` carrying
what is new: per candidate the next parts of its ``content`` (a piece of text, a
``functionCall`` whole), and on the last one its ``finishReason``; most chunks repeat
``usageMetadata``, ``modelVersion`` and ``responseId``, the last chunk's usage counting
everything. Without ``alt=sse`` the same chunks come as one JSON array. An error after the
headers is a chunk ``{"error": {"code", "message", "status"}}``.

:func:`fold` folds the chunks into the response a non-streamed call would have given:
candidates by their ``index``, each candidate's parts in order, a chunk's first text part
joined to the text before it when both are plain text of the same kind (an answer, or
a thought), every other field as the latest chunk says. :func:`synthesize` writes a
response as a one-chunk stream, which folds back into exactly that response.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from recorder.providers.base import data_lines, sse_events, string_spans

__all__ = ["assemble", "fold", "stream_pieces", "synthesize"]

# The keys a text part may have and still be joined to the text before it: a piece of an
# answer or of a thought (a thought signature, which Gemini sends with a part's last
# piece, may end it; nothing may follow one).
_TEXT_KEYS = frozenset({"text", "thought"})
_LAST_TEXT_KEYS = frozenset({"text", "thought", "thoughtSignature"})


def assemble(text: str) -> dict[str, Any]:
    """The response a recorded ``data:`` stream delivers (an ``error`` chunk kept as
    ``error``)."""
    chunks = []
    for _, data in sse_events(text):
        try:
            chunk = json.loads(data)
        except (ValueError, RecursionError):
            continue
        chunks.append(chunk)
    return fold(chunks)


def fold(chunks: list[Any]) -> dict[str, Any]:
    """The response that ``chunks`` (parsed) deliver one after another."""
    response: dict[str, Any] = {}
    for chunk in chunks:
        if not isinstance(chunk, dict):
            continue
        for key, value in chunk.items():
            if key == "candidates" and isinstance(value, list):
                if not isinstance(response.get("candidates"), list):
                    response["candidates"] = []
                into = response["candidates"]
                for n, candidate in enumerate(value):
                    if isinstance(candidate, dict):
                        _fold_candidate(into, candidate, n)
            else:
                response[key] = copy.deepcopy(value)
    return response


def _fold_candidate(candidates: list[Any], chunk: dict[str, Any], n: int) -> None:
    index = chunk.get("index", n)  # a stream that numbers no candidate: by position
    into = next((c for i, c in enumerate(candidates)
                 if isinstance(c, dict) and c.get("index", i) == index), None)
    if into is None:
        candidates.append(copy.deepcopy(chunk))
        return
    for key, value in chunk.items():
        if key == "content" and isinstance(value, dict) and isinstance(into.get(key), dict):
            _fold_content(into[key], value)
        else:
            into[key] = copy.deepcopy(value)


def _fold_content(content: dict[str, Any], chunk: dict[str, Any]) -> None:
    for key, value in chunk.items():
        if key != "parts" or not isinstance(value, list) or \
                not isinstance(content.get("parts"), list):
            content[key] = copy.deepcopy(value)
            continue
        parts = content["parts"]
        new = copy.deepcopy(value)
        if parts and new and _joins(parts[-1], new[0]):
            last, first = parts[-1], new.pop(0)
            last["text"] += first["text"]
            if "thoughtSignature" in first:
                last["thoughtSignature"] = first["thoughtSignature"]
        parts.extend(new)


def _joins(before: Any, piece: Any) -> bool:
    """Is ``piece`` the next piece of the text part ``before``?"""
    return (isinstance(before, dict) and isinstance(piece, dict)
            and isinstance(before.get("text"), str) and isinstance(piece.get("text"), str)
            and set(before) <= _TEXT_KEYS and set(piece) <= _LAST_TEXT_KEYS
            and bool(before.get("thought")) == bool(piece.get("thought")))


def synthesize(response: dict[str, Any]) -> str:
    """A complete ``alt=sse`` stream that delivers ``response``: itself, as one chunk."""
    return f"data: {json.dumps(response, separators=(',', ':'), ensure_ascii=False)}\r\n\r\n"


# ------------------------------------------------------------------ pieces, for redaction


def stream_pieces(body: bytes) -> list[list[tuple[int, int]]]:
    """For each text a stream sends in pieces (a candidate's answer, its thoughts), the
    byte spans of its pieces in ``body``. A line whose ``text`` values are not those of
    its parts (a ``text`` key elsewhere in it) is left out."""
    if b'"candidates"' not in body or b'"text"' not in body:
        return []  # no Gemini stream, or no text in it: nothing to read line by line
    values: dict[tuple[Any, ...], list[tuple[int, int]]] = {}
    for offset, line in data_lines(body):
        try:
            chunk = json.loads(line)
        except (ValueError, RecursionError):
            continue
        named = _texts(chunk)
        if not named:
            continue
        spans = string_spans(line, "text", [text for _, text in named])
        if spans is None:
            continue
        for (name, _), (start, end) in zip(named, spans, strict=True):
            values.setdefault(name, []).append((offset + start, offset + end))
    return list(values.values())


def _texts(chunk: Any) -> list[tuple[tuple[Any, ...], str]]:
    """(which text, piece) of each text part of a chunk, in order."""
    out: list[tuple[tuple[Any, ...], str]] = []
    candidates = chunk.get("candidates") if isinstance(chunk, dict) else None
    for n, candidate in enumerate(candidates if isinstance(candidates, list) else []):
        content = candidate.get("content") if isinstance(candidate, dict) else None
        parts = content.get("parts") if isinstance(content, dict) else None
        for part in parts if isinstance(parts, list) else []:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                out.append(((candidate.get("index", n), bool(part.get("thought"))),
                            part["text"]))
    return out
