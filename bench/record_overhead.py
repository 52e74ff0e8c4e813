"""Row 2: what recording adds to each call.

The same N non-streamed calls go to one stub server three ways: live (nothing
installed), inside ``recorder.record(tmpdir)`` at the default durability (fsync="turn":
model lines are forced to disk by a background group commit, off the call), and inside a
vcrpy cassette (record_mode="all"). Each call is timed on its own; the rounds rotate the order
of the three variants. Overhead = median per-call time of the variant minus the median
per-call time live, over all rounds' samples (difference of medians). Opening and closing
the session/cassette (deja's header and end line, vcrpy's save of the YAML file) is not
part of any call and is reported separately. For context two more numbers are taken:
deja at fsync="exit" (the same work without the per-turn fsync) and the bare cost of
one append + fsync of a cassette-sized line in the same directory (a fifth block of the
same rounds, so it sees the same disk conditions).
"""

from __future__ import annotations

import os
import time
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
    variants = ("live", "deja", "deja_exit", "vcr")
    samples: dict[str, list[float]] = {k: [] for k in variants}
    per_round: dict[str, list[float]] = {k: [] for k in variants}
    open_close: dict[str, list[float]] = {k: [] for k in variants if k != "live"}
    indices = range(n)
    with w.measurement("record overhead"), w.tempdir("overhead") as d, w.stub() as server:
        url = server.url
        counter = {"deja": 0, "deja_exit": 0, "vcr": 0}

        def live() -> None:
            times, out = w.timed_calls(w.client(url), indices)
            w.check_echo(out, indices)
            samples["live"].extend(times)
            per_round["live"].append(w.median(times))

        def deja(kind: str = "deja", **kwargs: Any) -> None:
            counter[kind] += 1
            t0 = time.perf_counter()
            # The default guards stay on; only the 200-turn default budget is lifted.
            with recorder.record(d / f"{kind}-{counter[kind]}.jsonl",
                                 budgets={"turns": 1_000_000}, **kwargs):
                t1 = time.perf_counter()
                times, out = w.timed_calls(w.client(url), indices)
                t2 = time.perf_counter()
            t3 = time.perf_counter()
            w.assert_unpatched("after deja recording")
            w.check_echo(out, indices)
            samples[kind].extend(times)
            per_round[kind].append(w.median(times))
            open_close[kind].append((t1 - t0) + (t3 - t2))

        def deja_exit() -> None:
            deja("deja_exit", fsync="exit")

        def vcr() -> None:
            counter["vcr"] += 1
            t0 = time.perf_counter()
            with w.vcr_instance("all").use_cassette(str(d / f"vcr-{counter['vcr']}.yaml")):
                t1 = time.perf_counter()
                times, out = w.timed_calls(w.client(url), indices)
                t2 = time.perf_counter()
            t3 = time.perf_counter()
            w.assert_unpatched("after vcrpy recording")
            w.check_echo(out, indices)
            samples["vcr"].extend(times)
            per_round["vcr"].append(w.median(times))
            open_close["vcr"].append((t1 - t0) + (t3 - t2))

        live()  # warm-up: imports, connection pool, stub threads
        samples["live"].clear()
        per_round["live"].clear()
        fsync_samples: list[float] = []

        def fsync() -> None:
            fsync_samples.extend(raw_fsync(d / "fsync.probe", n))

        w.run_blocks({"live": live, "deja": deja, "deja_exit": deja_exit, "vcr": vcr,
                      "fsync": fsync}, n_rounds)
        fsync_ms = w.ms(w.median(fsync_samples))

    med = {k: w.ms(w.median(v)) for k, v in samples.items()}
    return {
        "raw_fsync_ms": fsync_ms,
        "n": n, "rounds": n_rounds,
        "median_per_call_ms": med,
        "overhead_ms": {k: med[k] - med["live"] for k in variants if k != "live"},
        "per_round_median_ms": {k: [round(w.ms(x), 4) for x in v] for k, v in per_round.items()},
        "open_close_ms": {k: w.ms(w.median(v)) for k, v in open_close.items()},
        "method": "difference of medians of per-call times (all rounds pooled)",
    }
