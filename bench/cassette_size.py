"""Row 4: cassette bytes of one long conversation vs the conversation's unique content.

One conversation of T turns: each turn appends a new user message, sends the whole
conversation (``messages.create``, not streamed) and appends the assistant's reply, so
request t repeats the t-1 turns before it. The same conversation is recorded by deja
(default settings) and by vcrpy.

Unique content U = sum of len(canonical JSON) of every distinct message of every request
+ sum of len(canonical JSON) of every distinct request body without its ``messages``
(model, max_tokens, ...) + sum of the byte lengths of all response bodies as received.
Canonical JSON: sorted keys, separators (",", ":"), UTF-8, non-ASCII kept. Requests are
taken from what the stub server received; response bodies from the SDK's raw response.
Ratio = cassette file bytes / U.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import workloads as w

import recorder


def user_text(i: int) -> str:
    return (f"Step {i}: the search tool returned {i * 7 % 23 + 1} rows for query q{i}. "
            "Summarize what changed since the previous step and say what to check next.")


def canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def long_text(chars: int) -> Callable[[int], str]:
    """User messages of about ``chars`` characters (for the informative second run)."""
    def text(i: int) -> str:
        base = user_text(i) + " Context: "
        filler = " ".join(f"row{i}-{k}=value{(i * 31 + k) % 97}" for k in range(chars // 16))
        return (base + filler)[:chars]
    return text


def conversation(url: str, turns: int, text: Callable[[int], str] = user_text,
                 times: list[float] | None = None) -> list[bytes]:
    """Run the conversation; the raw response bodies (and each turn's time into ``times``)."""
    c = w.client(url)
    messages: list[dict[str, Any]] = []
    bodies = []
    for i in range(turns):
        messages.append({"role": "user", "content": text(i)})
        t0 = time.perf_counter()
        raw = c.messages.with_raw_response.create(model=w.MODEL, max_tokens=w.MAX_TOKENS * 4,
                                                   messages=list(messages))
        if times is not None:
            times.append(time.perf_counter() - t0)
        bodies.append(raw.http_response.content)
        reply = raw.parse()
        if reply.content[0].text != f"ok {text(i)}":
            raise RuntimeError(f"turn {i}: unexpected reply {reply.content[0].text!r}")
        messages.append({"role": "assistant", "content": reply.content[0].text})
    return bodies


def unique_bytes(requests: list[dict[str, Any]], bodies: list[bytes]) -> dict[str, int]:
    msgs: set[bytes] = set()
    rest: set[bytes] = set()
    for body in requests:
        msgs.update(canonical(m) for m in body["messages"])
        rest.add(canonical({k: v for k, v in body.items() if k != "messages"}))
    out = {"messages": sum(map(len, msgs)), "distinct_messages": len(msgs),
           "request_params": sum(map(len, rest)), "responses": sum(map(len, bodies))}
    out["total"] = out["messages"] + out["request_params"] + out["responses"]
    return out


def _deja(d: Path, name: str, turns: int, text: Callable[[int], str],
          times: list[float] | None = None) -> tuple[Path, Any, Any]:
    path = d / f"{name}.jsonl"
    with w.stub() as server:
        with recorder.record(path, budgets=recorder.Budgets()):
            bodies = conversation(server.url, turns, text, times)
        requests = [r["body"] for r in server.requests]
    w.assert_unpatched("after deja recording")
    return path, bodies, requests


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
            with w.stub() as server:
                conversation(server.url, turns, user_text, times)
        else:
            _deja(d, f"late-{r}", turns, user_text, times)
        late[kind] += times[-tail:]
        early[kind] += times[:tail]
    med = {k: w.ms(w.median(v)) for k, v in late.items()}
    med_early = {k: w.ms(w.median(v)) for k, v in early.items()}
    return {"turns": f"{turns - tail + 1}-{turns}", "median_ms": med,
            "overhead_ms": med["deja"] - med["live"],
            "first_turns_overhead_ms": med_early["deja"] - med_early["live"],
            "messages_per_request": [2 * (turns - tail) + 1, 2 * turns - 1]}


def _growth(path: Path, turns: int) -> dict[str, float]:
    """Bytes per turn of the first and second half of the turns (one line per turn)."""
    lines = path.read_bytes().split(b"\n")[1:turns + 1]
    half = turns // 2
    return {"first_half_per_turn": sum(len(x) + 1 for x in lines[:half]) / half,
            "second_half_per_turn": sum(len(x) + 1 for x in lines[half:]) / (turns - half)}


def run(*, turns: int = 200, large_chars: int = 0, late_rounds: int = 2) -> dict[str, Any]:
    with w.measurement("cassette size"), w.tempdir("size") as d:
        deja_path, bodies, requests = _deja(d, "deja", turns, user_text)
        vcr_path = d / "vcr.yaml"
        with w.stub() as server, w.vcr_instance("all").use_cassette(str(vcr_path)):
            conversation(server.url, turns)
        w.assert_unpatched("after vcrpy recording")
        unique = unique_bytes(requests, bodies)
        # Whole requests, for scale: what storing every request in full would take.
        full_requests = sum(len(canonical(r)) for r in requests)
        sizes = {"deja": deja_path.stat().st_size, "vcr": vcr_path.stat().st_size}
        out: dict[str, Any] = {
            "turns": turns, "requests": len(requests), "unique": unique,
            "full_requests_bytes": full_requests, "cassette_bytes": sizes,
            "ratio": {k: v / unique["total"] for k, v in sizes.items()},
            "growth": _growth(deja_path, turns),
        }
        if large_chars:
            # Informative only (the target is judged on the run above): same conversation
            # with longer user messages, to show how the fixed per-turn metadata amortizes.
            path, bodies, requests = _deja(d, "deja-long", turns, long_text(large_chars))
            big_unique = unique_bytes(requests, bodies)
            size = path.stat().st_size
            out["large_messages"] = {"message_chars": large_chars, "unique": big_unique,
                                     "cassette_bytes": {"deja": size},
                                     "ratio": {"deja": size / big_unique["total"]}}
        if late_rounds:
            out["late_overhead"] = _late_overhead(d, turns, late_rounds)
        return out
