"""Resume fast-forward: how long a resumed run takes to replay its recorded steps.

A run of N steps (N/2 model calls through the real SDK against the stub server, each
followed by a tool call) is recorded and left without an end line, as a crash leaves it.
``replayer.resume`` then re-runs the same agent: every recorded step is served from the
cassette (no request reaches the stub, which is stopped), and the clock stops when the
session goes live, i.e. when the recorded prefix is used up. The time includes loading
and verifying the cassette and reopening it for appending. Median of several resumes,
each on a fresh copy of the crashed cassette.
"""

from __future__ import annotations

import shutil
import time
from typing import Any

import workloads as w

import recorder
import replayer
from recorder.record import RecordSession


@recorder.tool
def lookup(i: int) -> dict[str, int]:
    return {"i": i, "square": i * i}


def agent(url: str, calls: int) -> None:
    c = w.client(url)
    for i in range(calls):
        w.call(c, i)
        lookup(i)


def run(*, steps: int = 1000, repeats: int = 5) -> dict[str, Any]:
    calls = steps // 2
    with w.measurement("resume"), w.tempdir("resume") as d:
        crashed = d / "crashed.jsonl"
        with w.stub() as server:
            url = server.url
            rec = RecordSession(crashed, budgets=recorder.Budgets(), loop_guard=False).start()
            try:
                agent(url, calls)
            finally:
                rec.abandon()  # no end line: the run "crashed" after its last step
        times = []
        for k in range(repeats):
            copy = d / f"resume-{k}.jsonl"
            shutil.copyfile(crashed, copy)
            t0 = time.perf_counter()
            live_at: list[float] = []
            with replayer.resume(copy) as session:
                write_resumed = session._on_live

                def went_live(s: Any, write: Any = write_resumed, seen: list = live_at) -> None:
                    seen.append(time.perf_counter())
                    write(s)

                session._on_live = went_live
                agent(url, calls)  # the stub is stopped: everything must be served
            if not live_at:
                raise RuntimeError("the resumed run never went live")
            times.append(live_at[0] - t0)
        return {"steps": steps, "bytes": crashed.stat().st_size, "times_s": times,
                "median_s": w.median(times), "repeats": repeats}
