"""The proxy rows: what ``deja proxy`` adds to a call, beside the same calls made directly.

Two processes besides this one: the stub Anthropic server (``python -m deja stub``, a
``StubServer``: a ``ThreadingHTTPServer``) and the proxy in record mode with its defaults
(guards, fsync="turn", one log line per request), started as a user starts it:
``python -m deja proxy --port 0 --ready-file F --upstream STUB --dir TMP``. A fresh proxy
serves each section (JSON or SSE, at one concurrency), so the open runs of one section do
not weigh on the next; the runs it holds open at the end are reported.

Workload: short agent conversations of ``TURNS`` model calls whose history grows turn by
turn, so the proxy routes every call after the first to its conversation's run (a new run,
with its cassette, per conversation). JSON: the anthropic SDK's ``messages.create`` (the
first ``TURNS - 1`` replies call a tool, the tool's result goes back). SSE: the same
conversations streamed, sent with httpx2 as the SDK sends them; time to first event =
request start -> the first chunk holding ``event:`` bytes; each stream is then read to its
end (so the recording is complete). No retries (``max_retries=0``): every failure counts.

Concurrency 1: the sync SDK / ``httpx2.Client``, blocks of conversations with direct and
proxied alternating, rotated each round (cancels drift of the machine). Concurrency 32 and
200: one asyncio loop, ``AsyncAnthropic`` / ``httpx2.AsyncClient`` with a connection limit
above the clients, each client running its conversations one call after another; every
client makes one untimed call first (connections open), then all start together. Each
call is timed on its own; reported: median and p95 per call over all rounds, errors,
throughput. Added = proxied median - direct median.

``python bench/proxy_speed.py --compare-clients`` compares the upstream clients the proxy
could use (httpx2.AsyncClient, aiohttp.ClientSession) forwarding the proxy's way (a built
request, the response streamed raw, closed) to the same stub, and prints the numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import httpx2
import workloads as w

TURNS = 5  # model calls per conversation
EVENT_DELAY_MS = 1  # between the stub's SSE events, so the first one travels alone
STREAM_MARK = "stream me"
PACED_MARK = "pace me"  # a stream whose events come PACE_MS apart (bench/proxy_gateway.py)
PACE_MS = 10
# 12 words -> 4 text deltas; 10 events per stream (message_start ... message_stop).
STREAM_TEXT = "one two three four five six seven eight nine ten eleven twelve"
PROXY_CMD = ["-m", "deja", "proxy"]  # after the interpreter (and cProfile, when profiled)
FORWARDER = Path(__file__).resolve().parent / "proxy_forwarder.py"
KINDS = ("direct", "forwarder", "proxied")  # the same calls: to the stub, through each
HEADERS = {"x-api-key": w.API_KEY, "anthropic-version": "2023-06-01",
           "content-type": "application/json", "accept": "application/json"}


def script() -> dict[str, Any]:
    """The agent turns for JSON conversations; a rule streams text to the SSE ones."""
    s = w.agent_script(TURNS)
    s["rules"] = [{"when": {"last_user_contains": PACED_MARK}, "text": STREAM_TEXT,
                   "event_delay_ms": PACE_MS},
                  {"when": {"last_user_contains": STREAM_MARK}, "text": STREAM_TEXT,
                   "event_delay_ms": EVENT_DELAY_MS}]
    return s


# ---------------------------------------------------------------------------- processes


@contextlib.contextmanager
def stub_process(d: Path) -> Iterator[str]:
    """The stub server serving :func:`script` in a process of its own."""
    with w.stub_process(d, script()) as url:
        yield url


@dataclass
class ProxyProc:
    proc: subprocess.Popen[bytes]
    url: str
    directory: Path
    log: Path

    def cpu_s(self) -> float | None:
        """CPU seconds the proxy process has used so far (user + system; Linux only)."""
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def rss_mib(self) -> float | None:
        """The process's resident memory now, in MiB (Linux only)."""
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return None

    def health(self) -> dict[str, Any]:
        with httpx2.Client(timeout=10) as c:
            return dict(c.get(self.url + "/_deja/health").json())


@contextlib.contextmanager
def proxy_process(d: Path, upstream: str, name: str,
                  profile: Path | None = None) -> Iterator[ProxyProc]:
    """``deja proxy`` in record mode with its defaults; stopped (SIGINT under cProfile, so
    that the profile is written; else SIGTERM) and checked to exit 0."""
    work = d / name
    work.mkdir()
    ready, log, cassettes = work / "ready.json", work / "proxy.log", work / "cassettes"
    cmd = [sys.executable, *(("-m", "cProfile", "-o", str(profile)) if profile else ()),
           *PROXY_CMD, "--port", "0", "--ready-file", str(ready),
           "--upstream", upstream, "--dir", str(cassettes)]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=work)
    p = ProxyProc(proc, "", cassettes, log)
    try:
        p.url = json.loads(w.wait_file(ready, proc, log, "deja proxy"))["url"]
        yield p
    finally:
        code = w.stop(proc, signal.SIGINT if profile else signal.SIGTERM)
        if code != 0:
            raise RuntimeError(f"deja proxy exited with {code}:\n{log.read_text()[-3000:]}")


@contextlib.contextmanager
def forwarder_process(d: Path, upstream: str, name: str) -> Iterator[ProxyProc]:
    """The bare forwarder (``bench/proxy_forwarder.py``: the proxy's server stack without
    deja) in front of ``upstream``."""
    work = d / name
    work.mkdir()
    ready, log = work / "ready.json", work / "forwarder.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, str(FORWARDER), "--port", "0",
                                 "--ready-file", str(ready), "--upstream", upstream],
                                stdout=out, stderr=subprocess.STDOUT, cwd=work)
    p = ProxyProc(proc, "", work, log)
    try:
        p.url = json.loads(w.wait_file(ready, proc, log, "the bare forwarder"))["url"]
        yield p
    finally:
        w.stop(proc)


@contextlib.contextmanager
def middles(d: Path, stub: str, name: str, profile: Path | None = None
            ) -> Iterator[dict[str, ProxyProc]]:
    """A fresh ``deja proxy`` and a fresh bare forwarder, both in front of the stub."""
    with forwarder_process(d, stub, f"{name}-fwd") as f, \
            proxy_process(d, stub, name, profile) as p:
        yield {"forwarder": f, "proxied": p}


# ---------------------------------------------------------------------------- statistics


def summary(times: list[float], errors: int, wall: float | None = None) -> dict[str, Any]:
    xs = sorted(times)
    out: dict[str, Any] = {"n": len(xs), "errors": errors}
    if xs:
        out.update(median_ms=w.ms(statistics.median(xs)), mean_ms=w.ms(statistics.fmean(xs)),
                   p95_ms=w.ms(xs[min(len(xs) - 1, int(0.95 * len(xs)))]),
                   p99_ms=w.ms(xs[min(len(xs) - 1, int(0.99 * len(xs)))]),
                   min_ms=w.ms(xs[0]))
    if wall:
        out["calls_per_s"] = len(xs) / wall
    return out


def compare(direct: dict[str, Any], proxied: dict[str, Any]) -> dict[str, Any]:
    if "median_ms" not in direct or "median_ms" not in proxied:
        return {}
    return {"added_ms": proxied["median_ms"] - direct["median_ms"],
            "added_p95_ms": proxied["p95_ms"] - direct["p95_ms"],
            "added_p99_ms": proxied["p99_ms"] - direct["p99_ms"],
            "ratio": proxied["median_ms"] / direct["median_ms"]}


def vs_direct(res: dict[str, Any]) -> dict[str, Any]:
    """The proxy's figures against direct at the top level (what the rows read), and the
    bare forwarder's under ``forwarder_vs_direct``."""
    return {**compare(res["direct"], res["proxied"]),
            "forwarder_vs_direct": compare(res["direct"], res["forwarder"])}


# ---------------------------------------------------------------------------- conversations


def _sse_body(conv: int, messages: list[dict[str, Any]]) -> bytes:
    return json.dumps({"model": w.MODEL, "max_tokens": w.MAX_TOKENS, "stream": True,
                       "messages": messages}).encode()


def _sse_next(conv: int, k: int) -> dict[str, Any]:
    return {"role": "user", "content": f"{STREAM_MARK}: conversation {conv}, turn {k}"}


def _check_stream(data: bytes, conv: int, k: int) -> None:
    if b"event: message_stop" not in data or b"eleven" not in data:
        raise RuntimeError(f"SSE conversation {conv}, call {k}: incomplete stream "
                           f"{data[:120]!r}")


def sse_conversation(c: httpx2.Client, url: str, conv: int, ttft: list[float],
                     total: list[float], first_calls: list[float] | None = None) -> None:
    messages = [_sse_next(conv, 0)]
    for k in range(TURNS):
        t0 = time.perf_counter()
        first: float | None = None
        parts: list[bytes] = []
        with c.stream("POST", url + "/v1/messages", content=_sse_body(conv, messages),
                      headers=HEADERS) as r:
            if r.status_code != 200:
                raise RuntimeError(f"SSE conversation {conv}: HTTP {r.status_code}")
            for chunk in r.iter_raw():
                if first is None and b"event:" in chunk:
                    first = time.perf_counter()
                parts.append(chunk)
        end = time.perf_counter()
        _check_stream(b"".join(parts), conv, k)
        assert first is not None
        ttft.append(first - t0)
        total.append(end - t0)
        if first_calls is not None and k == 0:
            first_calls.append(first - t0)
        messages += [{"role": "assistant", "content": STREAM_TEXT}, _sse_next(conv, k + 1)]


async def async_json_conversation(c: anthropic.AsyncAnthropic, conv: int,
                                  times: list[float]) -> None:
    """:func:`workloads.conversation` with the async SDK (replies checked the same way)."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": w.task_text(conv)}]
    for k in range(TURNS):
        t0 = time.perf_counter()
        request: dict[str, Any] = {"model": w.MODEL, "max_tokens": w.MAX_TOKENS,
                                   "messages": list(messages), "tools": w.TOOL_DEFS}
        msg = await c.messages.create(**request)
        times.append(time.perf_counter() - t0)
        text = "".join(b.text for b in msg.content if b.type == "text")
        tools = [{"type": "tool_use", "id": b.id, "name": b.name, "input": b.input}
                 for b in msg.content if b.type == "tool_use"]
        last = messages[-1]["content"]
        last_text = last if isinstance(last, str) else last[0]["content"]
        want_tools = [] if k == TURNS - 1 else [w.TOOLS[k % 2]]
        if text != f"ok {last_text}" or [t["name"] for t in tools] != want_tools:
            raise RuntimeError(f"conversation {conv}, call {k}: unexpected reply {text[:60]!r}")
        messages.append({"role": "assistant",
                         "content": [{"type": "text", "text": text}, *tools]})
        if tools:
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": tools[0]["id"],
                 "content": w.tool_output(conv, k)}]})


async def async_sse_conversation(c: httpx2.AsyncClient, url: str, conv: int,
                                 ttft: list[float], total: list[float]) -> None:
    messages = [_sse_next(conv, 0)]
    for k in range(TURNS):
        t0 = time.perf_counter()
        first: float | None = None
        parts: list[bytes] = []
        async with c.stream("POST", url + "/v1/messages", content=_sse_body(conv, messages),
                            headers=HEADERS) as r:
            if r.status_code != 200:
                raise RuntimeError(f"SSE conversation {conv}: HTTP {r.status_code}")
            async for chunk in r.aiter_raw():
                if first is None and b"event:" in chunk:
                    first = time.perf_counter()
                parts.append(chunk)
        end = time.perf_counter()
        _check_stream(b"".join(parts), conv, k)
        assert first is not None
        ttft.append(first - t0)
        total.append(end - t0)
        messages += [{"role": "assistant", "content": STREAM_TEXT}, _sse_next(conv, k + 1)]


def _limits(clients: int) -> httpx2.Limits:
    return httpx2.Limits(max_connections=clients + 50, max_keepalive_connections=clients + 50)


async def _concurrent(clients: int, convs: int, conv_base: int,
                      one: Callable[[int], Awaitable[None]],
                      warm: Callable[[int], Awaitable[None]]) -> tuple[int, float]:
    """``clients`` tasks, each running ``convs`` conversations; (errors, wall seconds)."""
    await asyncio.gather(*(warm(conv_base + 10_000_000 + k) for k in range(clients)))
    errors = 0

    async def client(k: int) -> None:
        nonlocal errors
        for j in range(convs):
            try:
                await one(conv_base + k * convs + j)
            except Exception:  # noqa: BLE001 - an error is counted, the client goes on
                errors += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(client(k) for k in range(clients)))
    return errors, time.perf_counter() - t0


def concurrent_json(url: str, clients: int, convs: int, conv_base: int
                    ) -> tuple[list[float], int, float]:
    times: list[float] = []

    async def main() -> tuple[int, float]:
        http = httpx2.AsyncClient(limits=_limits(clients), timeout=120)
        async with anthropic.AsyncAnthropic(base_url=url, api_key=w.API_KEY, max_retries=0,
                                            http_client=http) as c:
            async def warm(conv: int) -> None:
                await c.messages.create(model=w.MODEL, max_tokens=w.MAX_TOKENS,
                                        messages=[{"role": "user",
                                                   "content": w.task_text(conv)}])

            return await _concurrent(clients, convs, conv_base,
                                     lambda conv: async_json_conversation(c, conv, times), warm)

    errors, wall = asyncio.run(main())
    return times, errors, wall


def concurrent_sse(url: str, clients: int, convs: int, conv_base: int
                   ) -> tuple[list[float], list[float], int, float]:
    ttft: list[float] = []
    total: list[float] = []

    async def main() -> tuple[int, float]:
        async with httpx2.AsyncClient(limits=_limits(clients), timeout=120) as c:
            async def warm(conv: int) -> None:
                r = await c.post(url + "/v1/messages", content=_sse_body(conv, [
                    _sse_next(conv, 0)]), headers=HEADERS)
                r.raise_for_status()

            return await _concurrent(
                clients, convs, conv_base,
                lambda conv: async_sse_conversation(c, url, conv, ttft, total), warm)

    errors, wall = asyncio.run(main())
    return ttft, total, errors, wall


# ---------------------------------------------------------------------------- sections


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def take(self, k: int = 1) -> int:
        self.n += k
        return self.n - k


def _blocks(procs: dict[str, ProxyProc], fns: dict[str, Callable[[], None]], n_rounds: int,
            calls: dict[str, Callable[[], int]]) -> dict[str, Any]:
    """Run the blocks (rounds rotated); the CPU time of the proxy and of the forwarder over
    their own blocks, per call."""
    cpu: dict[str, list[float]] = {k: [] for k in procs}
    counted = {k: 0 for k in procs}

    def timed(kind: str) -> Callable[[], None]:
        def go() -> None:
            c0, n0 = procs[kind].cpu_s(), calls[kind]()
            fns[kind]()
            c1 = procs[kind].cpu_s()
            if c0 is not None and c1 is not None:
                cpu[kind].append(c1 - c0)
                counted[kind] += calls[kind]() - n0
        return go

    w.run_blocks({k: timed(k) if k in procs else fn for k, fn in fns.items()}, n_rounds)
    per = {k: w.ms(sum(cpu[k]) / counted[k]) if counted[k] else None for k in procs}
    return {"proxy_cpu_ms_per_call": per.get("proxied"),
            "forwarder_cpu_ms_per_call": per.get("forwarder")}


def _section_end(p: ProxyProc, expect_runs: int) -> dict[str, Any]:
    """What the proxy holds at the end of a section, and a check that it recorded a run
    per conversation (nothing lost, nothing merged)."""
    health = p.health()
    return {"runs_open": health["runs_open"], "proxy_requests": health["requests"],
            "conversations": expect_runs}


def _check_runs(p: ProxyProc, info: dict[str, Any]) -> None:
    files = list(p.directory.glob("r_*.jsonl"))
    info["cassettes"] = len(files)
    if len(files) != info["conversations"]:
        raise RuntimeError(f"the proxy wrote {len(files)} cassettes for "
                           f"{info['conversations']} conversations")


def _urls(stub: str, m: dict[str, ProxyProc]) -> dict[str, str]:
    return {"direct": stub, **{k: p.url for k, p in m.items()}}


def _rss(m: dict[str, ProxyProc]) -> dict[str, float | None]:
    return {k: p.rss_mib() for k, p in m.items()}


def json_one(stub: str, d: Path, ids: Counter, calls: int, block: int,
             profile: Path | None = None) -> dict[str, Any]:
    convs_per_block = max(1, block // TURNS)
    n_rounds = max(1, calls // (convs_per_block * TURNS))
    samples: dict[str, list[float]] = {k: [] for k in KINDS}
    firsts: dict[str, list[float]] = {k: [] for k in KINDS}
    run_count = 0
    with middles(d, stub, "json-1", profile) as m:
        p = m["proxied"]
        rss = {"idle": _rss(m)}
        clients = {k: anthropic.Anthropic(base_url=u, api_key=w.API_KEY, max_retries=0)
                   for k, u in _urls(stub, m).items()}

        def blockfn(kind: str) -> Callable[[], None]:
            def go() -> None:
                nonlocal run_count
                for _ in range(convs_per_block):
                    times: list[float] = []
                    w.conversation(clients[kind], ids.take(), TURNS, times=times)
                    samples[kind] += times
                    firsts[kind].append(times[0])
                    run_count += kind == "proxied"
            return go

        for kind in samples:  # warm-up: connections, both processes' first-call costs
            blockfn(kind)()
            samples[kind].clear()
            firsts[kind].clear()
        cpu = _blocks(m, {k: blockfn(k) for k in samples}, n_rounds,
                      {k: (lambda k=k: len(samples[k])) for k in m})
        rss["steady"] = _rss(m)
        info = {**_section_end(p, run_count), **cpu, "rss_mib": rss}
        for c in clients.values():
            c.close()
    _check_runs(p, info)
    res = {k: summary(v, 0) for k, v in samples.items()}
    return {**res, **vs_direct(res), **info,
            "first_call": {k: summary(v, 0) for k, v in firsts.items()},
            "rounds": n_rounds, "calls_per_block": convs_per_block * TURNS}


def sse_one(stub: str, d: Path, ids: Counter, calls: int, block: int) -> dict[str, Any]:
    convs_per_block = max(1, block // TURNS)
    n_rounds = max(1, calls // (convs_per_block * TURNS))
    ttft: dict[str, list[float]] = {k: [] for k in KINDS}
    total: dict[str, list[float]] = {k: [] for k in KINDS}
    firsts: dict[str, list[float]] = {k: [] for k in KINDS}
    run_count = 0
    with middles(d, stub, "sse-1") as m, httpx2.Client(timeout=60) as c:
        p = m["proxied"]
        urls = _urls(stub, m)

        def blockfn(kind: str) -> Callable[[], None]:
            def go() -> None:
                nonlocal run_count
                for _ in range(convs_per_block):
                    sse_conversation(c, urls[kind], ids.take(), ttft[kind], total[kind],
                                     firsts[kind])
                    run_count += kind == "proxied"
            return go

        for kind in ttft:
            blockfn(kind)()
            ttft[kind].clear()
            total[kind].clear()
            firsts[kind].clear()
        cpu = _blocks(m, {k: blockfn(k) for k in ttft}, n_rounds,
                      {k: (lambda k=k: len(ttft[k])) for k in m})
        info = {**_section_end(p, run_count), **cpu}
    _check_runs(p, info)
    res = {k: summary(v, 0) for k, v in ttft.items()}
    tot = {k: summary(v, 0) for k, v in total.items()}
    return {**res, **vs_direct(res), **info,
            "stream_total": {**tot, **vs_direct(tot)},
            "first_call": {k: summary(v, 0) for k, v in firsts.items()},
            "rounds": n_rounds, "calls_per_block": convs_per_block * TURNS}


def json_many(stub: str, d: Path, ids: Counter, clients: int, convs: int,
              n_rounds: int) -> dict[str, Any]:
    samples: dict[str, list[float]] = {k: [] for k in KINDS}
    errors = {k: 0 for k in KINDS}
    wall = {k: 0.0 for k in KINDS}
    with middles(d, stub, f"json-{clients}") as m:
        p = m["proxied"]
        urls = _urls(stub, m)

        def blockfn(kind: str) -> Callable[[], None]:
            def go() -> None:
                times, errs, secs = concurrent_json(urls[kind], clients, convs,
                                                    ids.take(clients * convs))
                samples[kind] += times
                errors[kind] += errs
                wall[kind] += secs
            return go

        cpu = _blocks(m, {k: blockfn(k) for k in samples}, n_rounds,
                      {k: (lambda k=k: len(samples[k])) for k in m})
        info = {**_section_end(p, n_rounds * clients * (convs + 1)), **cpu,
                "rss_after_mib": _rss(m)}
    if not errors["proxied"]:
        _check_runs(p, info)
    res = {k: summary(v, errors[k], wall[k]) for k, v in samples.items()}
    return {**res, **vs_direct(res), **info, "clients": clients,
            "conversations_per_client": convs, "rounds": n_rounds}


def sse_many(stub: str, d: Path, ids: Counter, clients: int, convs: int,
             n_rounds: int) -> dict[str, Any]:
    ttft: dict[str, list[float]] = {k: [] for k in KINDS}
    total: dict[str, list[float]] = {k: [] for k in KINDS}
    errors = {k: 0 for k in KINDS}
    wall = {k: 0.0 for k in KINDS}
    with middles(d, stub, f"sse-{clients}") as m:
        p = m["proxied"]
        urls = _urls(stub, m)

        def blockfn(kind: str) -> Callable[[], None]:
            def go() -> None:
                first, whole, errs, secs = concurrent_sse(urls[kind], clients, convs,
                                                          ids.take(clients * convs))
                ttft[kind] += first
                total[kind] += whole
                errors[kind] += errs
                wall[kind] += secs
            return go

        cpu = _blocks(m, {k: blockfn(k) for k in ttft}, n_rounds,
                      {k: (lambda k=k: len(ttft[k])) for k in m})
        info = {**_section_end(p, n_rounds * clients * (convs + 1)), **cpu}
    if not errors["proxied"]:
        _check_runs(p, info)
    res = {k: summary(v, errors[k], wall[k]) for k, v in ttft.items()}
    tot = {k: summary(v, errors[k], wall[k]) for k, v in total.items()}
    return {**res, **vs_direct(res), **info, "clients": clients,
            "stream_total": {**tot, **vs_direct(tot)},
            "conversations_per_client": convs, "rounds": n_rounds}


def run(*, calls: int = 300, block: int = 50, concurrency: tuple[int, ...] = (32, 200),
        convs_per_client: int = 2, conc_rounds: int = 2,
        frontier_levels: tuple[int, ...] = (1, 4, 16, 64), frontier_calls: int = 400,
        paced_streams: int = 60) -> dict[str, Any]:
    """Every proxy row's numbers (see the module's docstring)."""
    import proxy_gateway

    ids = Counter()
    out: dict[str, Any] = {"turns": TURNS, "event_delay_ms": EVENT_DELAY_MS, "calls": calls,
                           "json": {}, "sse": {}}
    with w.measurement("proxy"), w.tempdir("proxy") as d, stub_process(d) as stub:
        out["json"]["1"] = json_one(stub, d, ids, calls, block)
        out["sse"]["1"] = sse_one(stub, d, ids, calls, block)
        out["paced"] = proxy_gateway.paced_sse(stub, d, ids, paced_streams)
        for n in concurrency:
            out["json"][str(n)] = json_many(stub, d, ids, n, convs_per_client, conc_rounds)
            out["sse"][str(n)] = sse_many(stub, d, ids, n, convs_per_client, conc_rounds)
        out["frontier"] = proxy_gateway.frontier(stub, d, ids, frontier_levels,
                                                 frontier_calls)
    return out


# ---------------------------------------------------------------------------- upstream clients


def compare_clients(calls: int = 500, block: int = 100, concurrent: int = 32) -> dict[str, Any]:
    """Per call: httpx2.AsyncClient vs aiohttp.ClientSession, each forwarding the proxy's
    way (headers and body given, the response streamed raw to its end, then closed) to the
    stub, one call at a time and ``concurrent`` at a time; blocks alternate."""
    import aiohttp

    body_json = json.dumps({"model": w.MODEL, "max_tokens": w.MAX_TOKENS, "tools": w.TOOL_DEFS,
                            "messages": [{"role": "user", "content": w.task_text(1)}]}).encode()
    body_sse = _sse_body(1, [_sse_next(1, 0)])
    headers = list(HEADERS.items())
    results: dict[str, Any] = {"calls": calls, "block": block, "concurrent": concurrent}

    async def main(stub: str) -> None:
        url = stub + "/v1/messages"
        hx = httpx2.AsyncClient(timeout=httpx2.Timeout(600, connect=30.0),
                                limits=httpx2.Limits(max_connections=None,
                                                     max_keepalive_connections=256),
                                follow_redirects=False, trust_env=False)
        aio = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                    auto_decompress=False,
                                    timeout=aiohttp.ClientTimeout(total=600, connect=30))

        async def via_httpx2(body: bytes) -> bytes:
            req = hx.build_request("POST", url, headers=headers, content=body)
            r = await hx.send(req, stream=True)
            try:
                parts = [c async for c in r.aiter_raw()]
            finally:
                await r.aclose()
            return b"".join(parts)

        async def via_aiohttp(body: bytes) -> bytes:
            async with aio.request("POST", url, headers=headers, data=body) as r:
                parts = [c async for c in r.content.iter_any()]
            return b"".join(parts)

        fns = {"httpx2": via_httpx2, "aiohttp": via_aiohttp}
        for kind, body in (("json", body_json), ("sse", body_sse)):
            for conc in (1, concurrent):
                samples: dict[str, list[float]] = {k: [] for k in fns}
                for fn in fns.values():  # warm-up: connections
                    await asyncio.gather(*(fn(body) for _ in range(conc)))

                async def timed(fn: Callable[[bytes], Awaitable[bytes]], out: list[float],
                                n: int, body: bytes = body) -> None:
                    for _ in range(n):
                        t0 = time.perf_counter()
                        data = await fn(body)
                        out.append(time.perf_counter() - t0)
                        if not data:
                            raise RuntimeError("empty response")

                rounds = max(1, calls // block)
                for _, order in w.rounds(rounds, list(fns)):
                    for name in order:
                        per_task = max(1, block // conc) if conc > 1 else block
                        await asyncio.gather(*(timed(fns[name], samples[name], per_task)
                                               for _ in range(conc)))
                res = {k: summary(v, 0) for k, v in samples.items()}
                res["aiohttp_over_httpx2"] = (res["aiohttp"]["median_ms"]
                                              / res["httpx2"]["median_ms"])
                results[f"{kind}@{conc}"] = res
        await hx.aclose()
        await aio.close()

    with w.tempdir("clients") as d, stub_process(d) as stub:
        asyncio.run(main(stub))
    results["versions"] = {"httpx2": httpx2.__version__, "aiohttp": aiohttp.__version__}
    return results


def _isolate() -> None:
    """A throwaway DEJA_HOME and signing key, as bench/run.py sets (for running alone)."""
    if "DEJA_HOME" in os.environ and os.environ.get("DEJA_KEY", "").startswith("bench-"):
        return
    import atexit

    home = tempfile.mkdtemp(prefix="deja-bench-home-")
    atexit.register(shutil.rmtree, home, ignore_errors=True)
    os.environ["DEJA_HOME"] = home
    os.environ["DEJA_KEY"] = "bench-" + secrets.token_hex(16)
    os.environ.pop("DEJA_OLD_KEYS", None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="deja proxy speed (bench/run.py --only proxy "
                                     "prints the rows)")
    parser.add_argument("--compare-clients", action="store_true",
                        help="httpx2.AsyncClient vs aiohttp.ClientSession as the upstream client")
    parser.add_argument("--profile", metavar="FILE",
                        help="run the 1-client JSON section with the proxy under cProfile")
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args(argv)
    _isolate()
    if args.compare_clients:
        print(json.dumps(compare_clients(), indent=2))
    if args.profile:
        with w.tempdir("proxy-profile") as d, stub_process(d) as stub:
            res = json_one(stub, d, Counter(), args.calls, 50, profile=Path(args.profile))
        print(json.dumps(res, indent=2))
    if not args.compare_clients and not args.profile:
        print(json.dumps(run(calls=args.calls), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
