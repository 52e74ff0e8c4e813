"""Cassette bytes of one long agent conversation vs the conversation's unique content.

One conversation of T turns (:func:`workloads.conversation`): each turn sends the whole
conversation so far (``messages.create``, not streamed, with the tool definitions), the model
calls ``search`` and ``read_file`` alternately and the tool's result is appended as the next
user message, so request t repeats the t-1 turns before it. Tool results are short (~100
characters) or long (``large_chars``). A third kind of conversation is the agent as most are
written (:func:`workloads.sdk_conversation`): each answer, text + tool_use, goes back as the
SDK returned it (``msg.content``), tool-use ids are random and every tool result carries a
nonce, so the cassette must refer to each answer it repeats rather than store it again.
The same conversation is recorded by deja (default
settings), agent-rewind (``rewind.patch_anthropic()`` + ``rewind.record(path)``, defaults)
and vcrpy (record_mode="all"); vcrpy only up to ``vcr_max_turns`` turns (it stores every
request whole, in YAML, and takes minutes beyond that).

Unique content U = sum of len(canonical JSON) of every distinct message of every request
+ sum of len(canonical JSON) of every distinct request body without its ``messages``
(model, max_tokens, tools, ...) + sum of the byte lengths of all response bodies as
received. Canonical JSON: sorted keys, separators (",", ":"), UTF-8, non-ASCII kept.
Requests and response bodies are taken from one live run of the same conversation through
an in-process capture transport (:class:`workloads.Capture`). Ratio = cassette bytes / U.

The same agent in OpenAI's Responses API (:func:`responses`, recorded by deja only): the
conversation of :func:`openai_replay.responses_conversation` through the openai SDK
(``responses.create``, not streamed), each request carrying every ``input`` item so far (the
assistant's text, its ``function_call``, the tool's ``function_call_output``). U counts each
distinct input item instead of each distinct message. Bytes per turn at each length show
whether the cassette grows linearly (the same bytes per turn at 50 and at 800 turns).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx2
import openai_replay
import workloads as w

import recorder


def canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _script(turns: int, sdk: bool) -> dict[str, Any]:
    return w.sdk_script(turns) if sdk else w.agent_script(turns, echo=False)


def _converse(c: Any, turns: int, chars: int, sdk: bool,
              times: list[float] | None = None) -> None:
    """One conversation: the agent that builds its assistant messages itself, or with
    ``sdk`` the one that sends each answer back as the SDK returned it
    (:func:`workloads.sdk_conversation`: random tool-use ids, nonces)."""
    if sdk:
        w.sdk_conversation(c, 0, turns, chars=chars, times=times)
    else:
        w.conversation(c, 0, turns, chars=chars, echo=False, times=times)


def _live(turns: int, chars: int, sdk: bool = False
          ) -> tuple[list[dict[str, Any]], list[bytes]]:
    """The conversation run live once through :class:`workloads.Capture`: every request body
    as sent and every response body as received."""
    with w.stub(_script(turns, sdk)) as server:
        cap = w.Capture(server.url)
        try:
            _converse(cap.client(), turns, chars, sdk)
        finally:
            cap.close()
    return [json.loads(b) for b in cap.requests], [r[2] for r in cap.responses]


def unique_bytes(requests: list[dict[str, Any]], bodies: list[bytes],
                 history: str = "messages") -> dict[str, int]:
    """U of the conversation, whose requests resend their history as the list ``history``."""
    msgs: set[bytes] = set()
    rest: set[bytes] = set()
    for body in requests:
        msgs.update(canonical(m) for m in body[history])
        rest.add(canonical({k: v for k, v in body.items() if k != history}))
    out = {"messages": sum(map(len, msgs)), "distinct_messages": len(msgs),
           "request_params": sum(map(len, rest)), "responses": sum(map(len, bodies))}
    out["total"] = out["messages"] + out["request_params"] + out["responses"]
    return out


def _record(tool: str, path: Path, turns: int, chars: int,
            times: list[float] | None = None, sdk: bool = False) -> Path:
    """Record the conversation with one tool (deja at its defaults, vcrpy with
    record_mode="all", agent-rewind with rewind.record(path))."""
    with w.stub(_script(turns, sdk)) as server:
        def go() -> None:
            _converse(w.client(server.url), turns, chars, sdk, times)
        if tool == "deja":
            with recorder.record(path, budgets=recorder.Budgets()):
                go()
        elif tool == "vcr":
            with w.vcr_instance("all").use_cassette(str(path)):
                go()
        else:
            with w.rewind_patched() as rw, rw.record(path):
                go()
    w.assert_unpatched(f"after {tool} recording")
    return path


def _late_overhead(d: Path, turns: int, n_rounds: int) -> dict[str, Any]:
    """Per-call recording overhead late in the conversation (the last quarter of turns),
    where every request carries the whole conversation: deja (fsync="turn") vs live,
    difference of the medians of the per-turn times, rounds alternated."""
    tail = max(1, turns // 4)
    late: dict[str, list[float]] = {"live": [], "deja": []}
    early: dict[str, list[float]] = {"live": [], "deja": []}
    for r, order in w.rounds(2 * n_rounds, ["live", "deja"]):
        kind = order[0]
        times: list[float] = []
        if kind == "live":
            with w.stub(w.agent_script(turns, echo=False)) as server:
                w.conversation(w.client(server.url), 0, turns, echo=False, times=times)
        else:
            _record("deja", d / f"late-{r}.jsonl", turns, 0, times)
        late[kind] += times[-tail:]
        early[kind] += times[:tail]
    med = {k: w.ms(w.median(v)) for k, v in late.items()}
    med_early = {k: w.ms(w.median(v)) for k, v in early.items()}
    return {"turns": f"{turns - tail + 1}-{turns}", "of_turns": turns, "median_ms": med,
            "overhead_ms": med["deja"] - med["live"],
            "first_turns_overhead_ms": med_early["deja"] - med_early["live"],
            "messages_per_request": [2 * (turns - tail) + 1, 2 * turns - 1]}


def _growth(path: Path, turns: int) -> dict[str, float]:
    """Bytes per turn of the first and second half of the turns (one line per turn)."""
    lines = path.read_bytes().split(b"\n")[1:turns + 1]
    half = turns // 2
    return {"first_half_per_turn": sum(len(x) + 1 for x in lines[:half]) / half,
            "second_half_per_turn": sum(len(x) + 1 for x in lines[half:]) / (turns - half)}


def _one(d: Path, turns: int, chars: int, vcr_max_turns: int,
         have_rewind: bool, sdk: bool = False) -> dict[str, Any]:
    requests, bodies = _live(turns, chars, sdk)
    unique = unique_bytes(requests, bodies)
    tag = f"{turns}-{chars or 'short'}{'-sdk' if sdk else ''}"
    paths = {"deja": _record("deja", d / f"deja-{tag}.jsonl", turns, chars, sdk=sdk)}
    if have_rewind:
        paths["rewind"] = _record("rewind", d / f"rewind-{tag}.rewind", turns, chars, sdk=sdk)
    if turns <= vcr_max_turns:
        paths["vcr"] = _record("vcr", d / f"vcr-{tag}.yaml", turns, chars, sdk=sdk)
    sizes = {k: p.stat().st_size for k, p in paths.items()}
    out = {"turns": turns, "message_chars": chars, "sdk_answers": sdk,
           "requests": len(requests), "unique": unique,
           "full_requests_bytes": sum(len(canonical(r)) for r in requests),
           "cassette_bytes": sizes,
           "ratio": {k: v / unique["total"] for k, v in sizes.items()},
           "growth": _growth(paths["deja"], turns)}
    for p in paths.values():
        p.unlink()
    return out


def _responses_live(turns: int) -> tuple[list[dict[str, Any]], list[bytes]]:
    """The Responses conversation run live once through :class:`workloads.Capture`."""
    with w.stub(w.agent_script(turns)) as server:
        cap = w.Capture(server.url)
        try:
            client = openai_replay.client(cap.url, httpx2.Client(
                transport=httpx2.MockTransport(cap._handle)))
            openai_replay.responses_conversation(client, 0, turns, stream=False)
        finally:
            cap.close()
    return [json.loads(b) for b in cap.requests], [r[2] for r in cap.responses]


def responses(d: Path, turns: int) -> dict[str, Any]:
    """Cassette bytes of one Responses API conversation of ``turns`` calls, recorded by deja
    at its defaults, against its unique content."""
    requests, bodies = _responses_live(turns)
    unique = unique_bytes(requests, bodies, history="input")
    path = d / f"responses-{turns}.jsonl"
    with w.stub(w.agent_script(turns)) as server:
        with recorder.record(path, budgets=recorder.Budgets()):
            openai_replay.responses_conversation(openai_replay.client(server.url), 0, turns,
                                                 stream=False)
    w.assert_unpatched("after recording the Responses conversation")
    size = path.stat().st_size
    out = {"turns": turns, "requests": len(requests), "unique": unique,
           "full_requests_bytes": sum(len(canonical(r)) for r in requests),
           "cassette_bytes": size, "bytes_per_turn": size / turns,
           "ratio": size / unique["total"], "growth": _growth(path, turns)}
    path.unlink()
    return out


def run(*, turns: tuple[int, ...] = (50, 200, 800), large_chars: int = 1000,
        vcr_max_turns: int = 200, late_turns: int = 200, late_rounds: int = 2
        ) -> dict[str, Any]:
    have_rewind = w.rewind_version() is not None
    with w.measurement("cassette size"), w.tempdir("size") as d:
        runs = [_one(d, t, chars, vcr_max_turns, have_rewind)
                for t in turns for chars in (0, large_chars)]
        runs += [_one(d, t, 0, vcr_max_turns, have_rewind, sdk=True) for t in turns]
        out: dict[str, Any] = {"runs": runs, "vcr_max_turns": vcr_max_turns,
                               "large_chars": large_chars,
                               "rewind_version": w.rewind_version(),
                               "responses": [responses(d, t) for t in turns]}
        if late_rounds:
            out["late_overhead"] = _late_overhead(d, late_turns, late_rounds)
        return out
