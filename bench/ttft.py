"""Row 3: time to the first SSE event the agent sees, live vs recording.

The stub, in a process of its own as a remote API is, streams ~10 SSE events with
``event_delay_ms`` between them. For each call:
t0, ``client.messages.create(..., stream=True)``, iterate; TTFT = time to the first
``content_block_delta`` event; the stream is then read to its end (so the recording is
complete). Variants: live, inside ``recorder.record`` (default fsync), inside a vcrpy
cassette. Rounds rotate the variants; the reported value is the median over all calls.
"""

from __future__ import annotations

import time
from typing import Any

import workloads as w

import recorder

# 12 words -> 4 text deltas: message_start, ping, content_block_start, 4 x delta,
# content_block_stop, message_delta, message_stop = 10 events.
TEXT = "one two three four five six seven eight nine ten eleven twelve"


def _stream_once(c: Any, i: int) -> tuple[float, float, int]:
    t0 = time.perf_counter()
    first: float | None = None
    events = 0
    stream = c.messages.create(model=w.MODEL, max_tokens=w.MAX_TOKENS, stream=True,
                               messages=[{"role": "user", "content": w.prompt(i)}])
    for event in stream:
        events += 1
        if first is None and event.type == "content_block_delta":
            first = time.perf_counter()
    end = time.perf_counter()
    if first is None:
        raise RuntimeError("stream had no content_block_delta")
    return first - t0, end - t0, events


def run(*, calls_per_block: int = 10, n_rounds: int = 2, event_delay_ms: int = 20) -> dict:
    script = {"default": {"text": TEXT, "event_delay_ms": event_delay_ms}}
    ttft: dict[str, list[float]] = {"live": [], "deja": [], "vcr": []}
    total: dict[str, list[float]] = {"live": [], "deja": [], "vcr": []}
    n_events = 0
    with w.measurement("ttft"), w.tempdir("ttft") as d, w.stub_process(d, script) as url:
        counter = {"i": 0}

        def block(kind: str) -> None:
            nonlocal n_events
            c = w.client(url)
            for _ in range(calls_per_block):
                counter["i"] += 1
                first, end, n_events = _stream_once(c, counter["i"])
                ttft[kind].append(first)
                total[kind].append(end)

        def live() -> None:
            block("live")

        def deja() -> None:
            with recorder.record(d / f"deja-{counter['i']}.jsonl"):
                block("deja")
            w.assert_unpatched("after deja recording")

        def vcr() -> None:
            with w.vcr_instance("all").use_cassette(str(d / f"vcr-{counter['i']}.yaml")):
                block("vcr")
            w.assert_unpatched("after vcrpy recording")

        _stream_once(w.client(url), 0)  # warm-up
        w.run_blocks({"live": live, "deja": deja, "vcr": vcr}, n_rounds)

    med = {k: w.ms(w.median(v)) for k, v in ttft.items()}
    return {
        "calls": {k: len(v) for k, v in ttft.items()},
        "events_per_stream": n_events, "event_delay_ms": event_delay_ms,
        "ttft_median_ms": med,
        "stream_total_median_ms": {k: w.ms(w.median(v)) for k, v in total.items()},
        "deja_minus_live_ms": med["deja"] - med["live"],
        "vcr_minus_live_ms": med["vcr"] - med["live"],
    }
