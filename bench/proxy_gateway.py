"""The proxy figures independent gateway benchmarks publish, each beside the same calls
made directly to the stub and through the bare forwarder (``bench/proxy_forwarder.py``,
the proxy's server stack without deja), in the same run:

- **paced stream** (:func:`paced_sse`): one client, conversations of ``TURNS`` streamed
  calls whose events the stub sends ``PACE_MS`` apart; per call the time to the first
  event, and every gap between two events as the client receives them (inter-frame);
  blocks of direct, forwarded and proxied conversations alternate, rotated each round;
- **throughput frontier** (:func:`frontier`): the JSON conversations of the concurrent
  rows at rising concurrency (closed loop: each client sends its next call when the last
  is answered), a fresh proxy and forwarder for the whole sweep; per level calls/s and the
  p99 of a call; the frontier for a bound (5, 10, 50 ms) is the most calls/s any level
  reached with its p99 within it;
- **memory**: the proxy's and the forwarder's resident set (``VmRSS``) idle (listening,
  no call yet), steady (after the sweep's first level) and after load (after its last).
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any

import httpx2
import proxy_speed as ps
import workloads as w

BOUNDS_MS = (5, 10, 50)  # the p99 bounds of the frontier


def _paced_conversation(c: httpx2.Client, url: str, conv: int, ttft: list[float],
                        gaps: list[float]) -> None:
    """A streamed conversation of ``TURNS`` calls whose events come ``PACE_MS`` apart:
    each call's time to its first event, and the gaps between its events as they arrive."""
    messages = [{"role": "user", "content": f"{ps.PACED_MARK}: conversation {conv}, turn 0"}]
    for k in range(ps.TURNS):
        t0 = time.perf_counter()
        arrivals: list[float] = []
        parts: list[bytes] = []
        with c.stream("POST", url + "/v1/messages", content=ps._sse_body(conv, messages),
                      headers=ps.HEADERS) as r:
            if r.status_code != 200:
                raise RuntimeError(f"paced conversation {conv}: HTTP {r.status_code}")
            for chunk in r.iter_raw():
                if b"event:" in chunk:  # events that come together are one frame
                    arrivals.append(time.perf_counter())
                parts.append(chunk)
        ps._check_stream(b"".join(parts), conv, k)
        ttft.append(arrivals[0] - t0)
        gaps += [b - a for a, b in itertools.pairwise(arrivals)]
        messages += [{"role": "assistant", "content": ps.STREAM_TEXT},
                     {"role": "user", "content": f"{ps.PACED_MARK}: conversation {conv}, "
                                                 f"turn {k + 1}"}]


def paced_sse(stub: str, d: Path, ids: ps.Counter, streams: int) -> dict[str, Any]:
    """Time to first event and inter-frame gaps, direct, forwarded and proxied."""
    convs_per_block = 2
    n_rounds = max(1, streams // (convs_per_block * ps.TURNS))
    ttft: dict[str, list[float]] = {k: [] for k in ps.KINDS}
    gaps: dict[str, list[float]] = {k: [] for k in ps.KINDS}
    with ps.middles(d, stub, "paced") as m, httpx2.Client(timeout=60) as c:
        urls = ps._urls(stub, m)

        def blockfn(kind: str) -> Any:
            def go() -> None:
                for _ in range(convs_per_block):
                    _paced_conversation(c, urls[kind], ids.take(), ttft[kind], gaps[kind])
            return go

        for kind in ps.KINDS:  # warm-up
            blockfn(kind)()
            ttft[kind].clear()
            gaps[kind].clear()
        w.run_blocks({k: blockfn(k) for k in ps.KINDS}, n_rounds)
    first = {k: ps.summary(v, 0) for k, v in ttft.items()}
    frames = {k: ps.summary(v, 0) for k, v in gaps.items()}
    return {"pace_ms": ps.PACE_MS, "rounds": n_rounds, "ttft": {**first, **ps.vs_direct(first)},
            "gaps": {**frames, **ps.vs_direct(frames)}}


def frontier(stub: str, d: Path, ids: ps.Counter, levels: tuple[int, ...],
             calls: int) -> dict[str, Any]:
    """Calls/s and p99 per concurrency level, direct, forwarded and proxied; the frontier
    for each bound in :data:`BOUNDS_MS`; the middles' memory idle, steady, after load."""
    by_level: dict[str, dict[str, Any]] = {}
    rss: dict[str, Any] = {}
    with ps.middles(d, stub, "frontier") as m:
        urls = ps._urls(stub, m)
        rss["idle"] = ps._rss(m)
        for i, n in enumerate(levels):
            convs = max(1, round(calls / (n * ps.TURNS)))
            level: dict[str, Any] = {}
            for _, order in w.rounds(1 + i, list(ps.KINDS)):  # rotated level by level
                for kind in order:
                    times, errors, wall = ps.concurrent_json(urls[kind], n, convs,
                                                             ids.take(n * convs))
                    level[kind] = ps.summary(times, errors, wall)
                break
            by_level[str(n)] = level
            if i == 0:
                rss["steady"] = ps._rss(m)
        rss["after_load"] = ps._rss(m)
    out: dict[str, Any] = {"levels": by_level, "rss_mib": rss, "bounds_ms": list(BOUNDS_MS)}
    for bound in BOUNDS_MS:
        out[f"p99_{bound}ms"] = {kind: _best(by_level, kind, bound) for kind in ps.KINDS}
    return out


def _best(by_level: dict[str, dict[str, Any]], kind: str, bound: float) -> dict[str, Any]:
    """The level with the most calls/s whose p99 is within ``bound`` ms, without errors
    (calls/s 0 when none is)."""
    fits = [(m["calls_per_s"], int(n)) for n, level in by_level.items()
            if (m := level[kind]).get("p99_ms", bound + 1) <= bound and not m["errors"]]
    if not fits:
        return {"calls_per_s": 0.0, "clients": None}
    best = max(fits)
    return {"calls_per_s": best[0], "clients": best[1]}

