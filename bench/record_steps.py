"""Where recording's time goes: each step of a recorded call, in the agent's own process.

``python bench/record_steps.py`` runs the workload of the recording row
(``bench/record_overhead.py``: conversations of ``workloads.CONV_TURNS`` calls whose history
grows, two tools alternating, the real anthropic SDK against the stub server) live and
inside ``recorder.record`` (its defaults: ``fsync="turn"``, every guard; the turns budget
raised, as in the row), in rounds of one block of each, their order alternating. It prints:

- each step of a recorded call, timed where it runs, as CPU per call: the CPU time of the
  thread that ran it (``time.thread_time``, which waiting for the interpreter lock or for
  the machine's CPUs does not count; a machine slower on the whole still slows it). An
  indented step is part of the one above it; each timed step also carries the cost of
  the timing (two clock reads, about a microsecond), and those nested in it theirs;
- the work recording moves off the call: the group commit (``fsync``) and the status
  record, in deja's background thread; and the garbage collector's passes, in recorded
  and in live blocks;
- the agent thread's CPU per call in the live and the recorded blocks, median and range.
  Their difference also holds what the steps leave out (deja's request and response
  objects around httpx's, the tee the response's bytes go through), but blocks vary more
  from one to the next than that, on a busy machine: the steps are the figures to read.
"""



from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

from proxy_steps import GC, Stats, time_gc, wrap

# (module, attribute path, label), outermost first; "  " marks a step inside the one above
STEPS = (
    ("recorder.record", "RecordSession.begin_http", "before the call (all of it)"),
    ("recorder.record", "RecordSession.before_call", "  the guards (budgets, cancel, breaker)"),
    ("recorder.step_lines", "StepLines.classify",
     "  the request read: secrets redacted, parsed from where it stops repeating, digest"),
    ("recorder.record", "RecordSession.end_http", "after the response (all of it)"),
    ("recorder.step_lines", "response_record", "  the response: secrets redacted"),
    ("recorder.step_lines", "StepLines._model_outcome", "  its usage, stop reason and cost"),
    ("recorder.cassette.compact", "Compactor.compact",
     "  compaction (what a reader derives left out, headers as edits)"),
    ("recorder.cassette.writer", "CassetteWriter.append",
     "  the line appended: request as a delta, JSON, signature, write"),
    ("recorder.harness.run_guard", "RunGuard.after_exchange",
     "  the guards after it (usage, loop, breaker)"),
    ("recorder.cassette.writer", "_GroupSync._sync", "group commit: fsync (background thread)"),
    ("recorder.harness.progress", "Progress._write", "status record (any thread)"),
)

BUDGETS = {"turns": 1_000_000}  # as the recording row: no budget stops the workload


def measure(calls: int = 300, rounds: int = 5, *, stream: bool = False) -> dict[str, Any]:
    """The figures of ``rounds`` rounds of ``calls`` calls each way (``stream``: streamed
    calls, whose first event waits for what is done before the call)."""
    if os.environ.get("DEJA_HOME"):
        return _measure(calls, rounds, stream)
    with tempfile.TemporaryDirectory(prefix="deja-record-steps-") as home:
        os.environ["DEJA_HOME"] = home  # its signing key goes with it
        try:
            return _measure(calls, rounds, stream)
        finally:
            del os.environ["DEJA_HOME"]


def _measure(calls: int, rounds: int, stream: bool) -> dict[str, Any]:
    import workloads as w

    import recorder

    stats = Stats()
    wrap(stats, STEPS)
    timing_gc = time_gc(stats)
    cpu: dict[str, list[float]] = {"live": [], "recorded": []}
    gc_cpu = {"live": 0.0, "recorded": 0.0}
    with w.tempdir("record-steps") as d, w.stub(w.agent_script(w.CONV_TURNS)) as server:
        w.agent_run(w.client(server.url), 60, stream=stream)  # warm-up: imports, first calls
        with recorder.record(d / "warm.jsonl", budgets=BUDGETS):
            w.agent_run(w.client(server.url), 60, stream=stream)
        stats.clear()  # the warm-up is not counted
        for r in range(rounds):
            for kind in ("live", "recorded") if r % 2 == 0 else ("recorded", "live"):
                before = stats.cpu.get(GC, 0.0)
                c0 = time.thread_time()
                if kind == "live":
                    w.agent_run(w.client(server.url), calls, stream=stream)
                else:
                    with recorder.record(d / f"r{r}.jsonl", budgets=BUDGETS):
                        w.agent_run(w.client(server.url), calls, stream=stream)
                cpu[kind].append((time.thread_time() - c0) / calls * 1e6)
                gc_cpu[kind] += stats.cpu.get(GC, 0.0) - before
    gc.callbacks.remove(timing_gc)
    raw = stats.snapshot()
    n = rounds * calls
    steps = [{"step": label, "cpu_us_per_call": raw["cpu"].get(label, 0.0) / n * 1e6,
              "n": len(raw["wall"].get(label, []))} for _, _, label in STEPS]
    live, recorded = statistics.median(cpu["live"]), statistics.median(cpu["recorded"])
    return {"calls": n, "stream": stream, "live_us": live, "recorded_us": recorded,
            "added_us": recorded - live,
            "live_rounds_us": cpu["live"], "recorded_rounds_us": cpu["recorded"],
            "gc_us": {k: v / n * 1e6 for k, v in gc_cpu.items()}, "steps": steps}


def table(res: dict[str, Any]) -> str:
    rows = ["| step | CPU per call |", "|---|---|"]
    for s in res["steps"]:
        label = s["step"]
        name = f"&nbsp;&nbsp;{label.strip()}" if label.startswith("  ") else label
        rows.append(f"| {name} | {s['cpu_us_per_call']:.0f} µs |")
    rows.append(f"| garbage collection, recorded / live | {res['gc_us']['recorded']:.0f} / "
                f"{res['gc_us']['live']:.0f} µs |")
    rec, live = res["recorded_rounds_us"], res["live_rounds_us"]
    rows.append(f"| the agent's thread, recorded / live: medians (range of the rounds) | "
                f"{res['recorded_us']:.0f} ({min(rec):.0f}-{max(rec):.0f}) / "
                f"{res['live_us']:.0f} ({min(live):.0f}-{max(live):.0f}) µs |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="recording's time, step by step")
    parser.add_argument("--calls", type=int, default=300,
                        help="calls per block (a multiple of the conversation's turns)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds of one live and one recorded block")
    parser.add_argument("--stream", action="store_true",
                        help="streamed calls (the time to the first event row's workload)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    import workloads as w

    if args.calls < 1 or args.calls % w.CONV_TURNS or args.rounds < 1:
        parser.error(f"--calls must be a multiple of {w.CONV_TURNS} and --rounds at least 1")
    res = measure(args.calls, args.rounds, stream=args.stream)
    print(json.dumps(res, indent=2) if args.json else table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
