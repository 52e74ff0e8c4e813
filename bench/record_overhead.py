"""Row 2: what recording adds to each call.

The same N non-streamed calls (the agent workload of :func:`workloads.agent_run`:
conversations of ``workloads.CONV_TURNS`` calls whose history grows turn by turn, two tools
alternating) go to one stub server, in a process of its own as a remote API is (an
in-process stub would share the agent's interpreter lock and CPU time with deja's work),
four ways: live (nothing installed), inside
``recorder.record(tmpdir)`` at the default durability (fsync="turn": model lines are forced to
disk by a background group commit, off the call), inside a vcrpy cassette
(record_mode="all"), and inside agent-rewind's ``rewind.record(path)`` with
``rewind.patch_anthropic()`` installed (its default: one flushed JSON line per call, no
fsync). Each call is timed on its own; the rounds rotate the order of the variants.
Overhead = median per-call time of the variant minus the median per-call time live, over
all rounds' samples (difference of medians). Opening and closing the session/cassette
(deja's header and end line, vcrpy's save of the YAML file, agent-rewind's header) is not
part of any call and is reported separately. For context two more numbers are taken: deja
at fsync="exit" (the same work without the per-turn fsync) and the bare cost of one append +
fsync of a cassette-sized line in the same directory (a block of the same rounds, so it sees
the same disk conditions).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import workloads as w

import recorder


def raw_fsync(path: Path, n: int, size: int = 1700) -> list[float]:
    """What one append + fsync of a cassette-sized line costs on this filesystem."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    out = []
    try:
        for _ in range(n):
            os.write(fd, b"x" * (size - 1) + b"\n")
            t0 = time.perf_counter()
            os.fsync(fd)
            out.append(time.perf_counter() - t0)
    finally:
        os.close(fd)
        path.unlink()
    return out


def run(*, n: int = 300, n_rounds: int = 5) -> dict[str, Any]:
    have_rewind = w.rewind_version() is not None
    variants = ("live", "deja", "deja_exit", "vcr", *(("rewind",) if have_rewind else ()))
    samples: dict[str, list[float]] = {k: [] for k in variants}
    per_round: dict[str, list[float]] = {k: [] for k in variants}
    open_close: dict[str, list[float]] = {k: [] for k in variants if k != "live"}
    with (w.measurement("record overhead"), w.tempdir("overhead") as d,
          w.stub_process(d, w.agent_script(w.CONV_TURNS)) as url):
        counter = {"deja": 0, "deja_exit": 0, "vcr": 0, "rewind": 0}

        def live() -> None:
            times: list[float] = []
            w.agent_run(w.client(url), n, times=times)
            samples["live"].extend(times)
            per_round["live"].append(w.median(times))

        def timed(kind: str, session: Callable[[Path], AbstractContextManager[Any]],
                  suffix: str, where: str | None) -> None:
            """One recorded block: its per-call times, and the session's open + close;
            no patch left behind after it (``where``: checked by the caller when None)."""
            counter[kind] += 1
            t0 = time.perf_counter()
            with session(d / f"{kind}-{counter[kind]}{suffix}"):
                t1 = time.perf_counter()
                times: list[float] = []
                w.agent_run(w.client(url), n, times=times)
                t2 = time.perf_counter()
            t3 = time.perf_counter()
            if where is not None:
                w.assert_unpatched(f"after {where} recording")
            samples[kind].extend(times)
            per_round[kind].append(w.median(times))
            open_close[kind].append((t1 - t0) + (t3 - t2))

        def deja(kind: str = "deja", **kwargs: Any) -> None:
            # The default guards stay on; only the 200-turn default budget is lifted.
            timed(kind, lambda path: recorder.record(path, budgets={"turns": 1_000_000},
                                                     **kwargs), ".jsonl", "deja")

        def deja_exit() -> None:
            deja("deja_exit", fsync="exit")

        def vcr() -> None:
            timed("vcr", lambda path: w.vcr_instance("all").use_cassette(str(path)), ".yaml",
                  "vcrpy")

        def rewind() -> None:
            with w.rewind_patched() as rw:  # the patch itself is not part of the session
                timed("rewind", rw.record, ".rewind", None)
            w.assert_unpatched("after agent-rewind recording")

        live()  # warm-up: imports, connection pool, stub threads
        samples["live"].clear()
        per_round["live"].clear()
        fsync_samples: list[float] = []

        def fsync() -> None:
            fsync_samples.extend(raw_fsync(d / "fsync.probe", n))

        blocks = {"live": live, "deja": deja, "deja_exit": deja_exit, "vcr": vcr,
                  "fsync": fsync}
        if have_rewind:
            blocks["rewind"] = rewind
        w.run_blocks(blocks, n_rounds)
        fsync_ms = w.ms(w.median(fsync_samples))

    med = {k: w.ms(w.median(v)) for k, v in samples.items()}
    return {
        "raw_fsync_ms": fsync_ms,
        "n": n, "rounds": n_rounds, "conv_turns": w.CONV_TURNS,
        "rewind_version": w.rewind_version(),
        "median_per_call_ms": med,
        "overhead_ms": {k: med[k] - med["live"] for k in variants if k != "live"},
        "per_round_median_ms": {k: [round(w.ms(x), 4) for x in v] for k, v in per_round.items()},
        "open_close_ms": {k: w.ms(w.median(v)) for k, v in open_close.items()},
        "method": "difference of medians of per-call times (all rounds pooled)",
    }
