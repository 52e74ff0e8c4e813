"""Where the recording proxy's time goes: each step of a call, in the proxy's own process.

``python bench/proxy_steps.py`` starts the stub, a bare forwarder and ``deja proxy`` (record
mode, its defaults) as ``bench/proxy_speed.py`` does, but the proxy runs under this file's
``serve`` mode: the same ``deja proxy`` command, with each step of a call timed where it
runs. The conversations of the proxy rows (``TURNS`` calls each, a new run per
conversation, a tool result in every call but the first) go through the proxy one at a
time, and the table printed gives, per step:

- how many times it ran, and its median wall time;
- its CPU time per model call: the CPU the thread running it used while it ran
  (``time.thread_time``, which waiting for the interpreter lock or for a CPU does not
  count, so the figure holds on a busy machine), summed and divided by the calls.

Beside them, the whole proxy process's CPU per call (user + system, every thread) and the
bare forwarder's on the same calls: what is left after the steps is the server stack,
asyncio and the forwarding itself, which the forwarder also pays.

An asynchronous step (the body read, the routing, the forwarding) is timed across its
awaits: with one client nothing else runs on the event loop meanwhile, except a new run's
start, which runs in a worker thread and is counted on its own (``run start``).
"""

from __future__ import annotations

import argparse
import atexit
import functools
import inspect
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# (module, attribute path, label): each is wrapped in the proxy's process before it starts.
STEPS = (
    ("deja.proxy.app", "Proxy._body", "read the request body"),
    ("deja.proxy.app", "Proxy._read_model_request", "parse the request, message keys"),
    ("deja.proxy.app", "Proxy._route", "route to its run (a new run: awaited)"),
    ("recorder.record", "RecordSession.start", "run start (worker thread)"),
    ("deja.proxy.app", "Proxy._results", "read its tool results"),
    ("deja.proxy.app", "boundary", "tool line and the loop guard"),
    ("recorder.record", "RecordSession.before_call", "guards before the call"),
    ("deja.proxy._respond", "Responder.forward", "forward, pass back, log (all)"),
    ("recorder.record", "RecordSession.end_http", "exchange line (after the response)"),
    ("deja.proxy._respond", "read_reply", "read the reply's tool calls"),
    ("recorder.cassette.writer", "_GroupSync._sync", "group commit: fsync (chore thread)"),
    ("recorder.harness.progress", "Progress._write", "status record (any thread)"),
)


class Stats:
    """Times per step, added from the proxy's event loop and from its worker threads."""

    def __init__(self) -> None:
        self.wall: dict[str, list[float]] = {}
        self.cpu: dict[str, float] = {}
        self._lock = threading.RLock()  # a GC pass inside add() adds its own time

    def clear(self) -> None:
        with self._lock:
            self.wall.clear()
            self.cpu.clear()

    def add(self, label: str, wall: float, cpu: float) -> None:
        with self._lock:
            self.wall.setdefault(label, []).append(wall)
            self.cpu[label] = self.cpu.get(label, 0.0) + cpu

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"wall": {k: list(v) for k, v in self.wall.items()}, "cpu": dict(self.cpu)}


def timed(fn: Callable[..., Any], label: str, stats: Stats) -> Callable[..., Any]:
    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def run_async(*args: Any, **kwargs: Any) -> Any:
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return await fn(*args, **kwargs)
            finally:
                stats.add(label, time.perf_counter() - t0, time.thread_time() - c0)
        return run_async

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            stats.add(label, time.perf_counter() - t0, time.thread_time() - c0)
    return run


def wrap(stats: Stats, steps: tuple[tuple[str, str, str], ...] = STEPS) -> None:
    import importlib

    for module_name, path, label in steps:
        owner: Any = importlib.import_module(module_name)
        *outer, name = path.split(".")
        for part in outer:
            owner = getattr(owner, part)
        raw = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        static = isinstance(raw, staticmethod)
        wrapped = timed(raw.__func__ if static else raw, label, stats)
        setattr(owner, name, staticmethod(wrapped) if static else wrapped)


GC = "garbage collection (any thread)"


def time_gc(stats: Stats) -> Callable[[str, dict[str, Any]], None]:
    """Each pass of the cyclic garbage collector, as a step (:data:`GC`); returns the
    callback, for ``gc.callbacks.remove``."""
    import gc

    started: dict[int, tuple[float, float]] = {}

    def callback(phase: str, info: dict[str, Any]) -> None:
        me = threading.get_ident()
        if phase == "start":
            started[me] = (time.perf_counter(), time.thread_time())
        elif me in started:
            t0, c0 = started.pop(me)
            stats.add(GC, time.perf_counter() - t0, time.thread_time() - c0)

    gc.callbacks.append(callback)
    return callback


def serve(stats_file: Path, proxy_args: list[str]) -> None:
    """``deja proxy PROXY_ARGS`` with its steps timed; the figures go to ``stats_file``
    when it exits."""
    stats = Stats()
    wrap(stats)
    time_gc(stats)

    def dump() -> None:
        stats_file.write_text(json.dumps(stats.snapshot()))

    atexit.register(dump)
    from deja.cli import main as deja_main

    sys.argv = ["deja", "proxy", *proxy_args]
    deja_main()


def measure(conversations: int = 200, rounds: int = 4) -> dict[str, Any]:
    """The steps of ``conversations`` conversations through the timed proxy, and both
    processes' CPU per call, in ``rounds`` alternating blocks with the forwarder."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import anthropic
    import proxy_speed as ps
    import workloads as w

    ps._isolate()
    stats_file = Path(os.environ["DEJA_HOME"]) / "proxy-steps.json"
    saved = ps.PROXY_CMD
    ps.PROXY_CMD = [str(Path(__file__).resolve()), "serve", str(stats_file), "--"]
    ids = ps.Counter()
    cpu: dict[str, float] = {"proxied": 0.0, "forwarder": 0.0}
    calls = {"proxied": 0, "forwarder": 0}
    try:
        with w.tempdir("proxy-steps") as d, ps.stub_process(d) as stub, \
                ps.middles(d, stub, "steps") as m:
            clients = {k: anthropic.Anthropic(base_url=p.url, api_key=w.API_KEY,
                                              max_retries=0) for k, p in m.items()}
            for c in clients.values():  # warm-up: connections, first-call costs
                w.conversation(c, ids.take(), ps.TURNS)
            per_block = max(1, conversations // rounds)
            for _ in range(rounds):
                for kind, c in clients.items():
                    c0 = m[kind].cpu_s()
                    for _ in range(per_block):
                        w.conversation(c, ids.take(), ps.TURNS)
                    c1 = m[kind].cpu_s()
                    if c0 is not None and c1 is not None:
                        cpu[kind] += c1 - c0
                    calls[kind] += per_block * ps.TURNS
            for c in clients.values():
                c.close()
    finally:
        ps.PROXY_CMD = saved
    raw = json.loads(stats_file.read_text())
    # the warm-up's conversation is in the steps too: one more per kind
    model_calls = calls["proxied"] + ps.TURNS
    steps = []
    for label in [label for _, _, label in STEPS] + [GC]:
        walls = raw["wall"].get(label, [])
        steps.append({"step": label, "n": len(walls),
                      "median_wall_us": statistics.median(walls) * 1e6 if walls else None,
                      "cpu_us_per_call": raw["cpu"].get(label, 0.0) / model_calls * 1e6})
    return {"conversations": rounds * per_block, "turns": ps.TURNS, "calls": calls["proxied"],
            "steps": steps,
            "proxy_cpu_us_per_call": cpu["proxied"] / calls["proxied"] * 1e6,
            "forwarder_cpu_us_per_call": cpu["forwarder"] / calls["forwarder"] * 1e6}


def table(res: dict[str, Any]) -> str:
    rows = ["| step | runs | median wall | CPU per call |", "|---|---|---|---|"]
    for s in res["steps"]:
        wall = f"{s['median_wall_us']:.0f} µs" if s["median_wall_us"] is not None else "-"
        rows.append(f"| {s['step']} | {s['n']} | {wall} | {s['cpu_us_per_call']:.0f} µs |")
    rows.append(f"| whole proxy process (every thread) | | | "
                f"{res['proxy_cpu_us_per_call']:.0f} µs |")
    rows.append(f"| bare forwarder, same calls | | | {res['forwarder_cpu_us_per_call']:.0f} µs |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        rest = argv[2:]
        serve(Path(argv[1]), rest[1:] if rest[:1] == ["--"] else rest)
        return 0
    parser = argparse.ArgumentParser(description="the recording proxy's time, step by step")
    parser.add_argument("--conversations", type=int, default=200,
                        help="conversations through the proxy (TURNS calls each)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    res = measure(args.conversations)
    print(json.dumps(res, indent=2) if args.json else table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
