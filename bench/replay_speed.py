"""Row 1: replay cost per call, deja vs vcrpy, at two cassette sizes.

Both cassettes are recorded from the same workload against the same stub (same base
URL, which vcrpy's ``uri`` matcher needs); the stub is stopped before any replay, so a
request that escaped replay would fail to connect.

Per-call time = (time of N ``messages.create`` calls) / N, with a fresh client made inside
the replay; constructing it (~20 ms, mostly the SSL context) is timed apart, as it is no
call and would otherwise make small replays look slower per call. Load time (reading and
verifying the cassette, installing patches: the ``__enter__`` of ``replayer.replay(...)``
/ ``use_cassette(...)``) is measured separately.
deja: median of ``repeats`` replays at each size, after one untimed warm-up replay.
vcrpy: median of ``vcr_repeats`` replays at the small size. At the large size vcrpy's
matcher scans the interactions linearly for every call (O(N) per call, ~5 minutes for
2,000 calls), so by default it replays every ``stride``-th call of the full cassette once:
its cost per call depends only on where the match sits, so a uniform sample of positions
estimates the full run's mean per-call time. ``full_vcr`` replays all calls instead.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Any

import workloads as w

import recorder
import replayer


def _record_deja(url: str, n: int, path: Path) -> Path:
    with recorder.record(path, budgets=recorder.Budgets()):
        c = w.client(url)
        w.check_echo(w.calls(c, range(n)), range(n))
    return path


def _record_vcr(url: str, n: int, path: Path) -> Path:
    with w.vcr_instance("all").use_cassette(str(path)):
        c = w.client(url)
        w.check_echo(w.calls(c, range(n)), range(n))
    return path


def _deja_replay(path: Path, url: str, indices: list[int], n_recorded: int) -> dict[str, float]:
    t0 = time.perf_counter()
    cm = replayer.replay(path, raise_on_divergence=False)
    cm.__enter__()
    t1 = time.perf_counter()
    try:
        c = w.client(url)
        t1c = time.perf_counter()
        out = w.calls(c, indices)
        t2 = time.perf_counter()
    finally:
        cm.__exit__(None, None, None)
    w.check_echo(out, indices)
    result = cm.result
    assert result is not None
    if result.divergence is not None and len(indices) == n_recorded:
        raise RuntimeError(f"deja replay diverged: {result.report()}")
    return {"load_s": t1 - t0, "client_s": t1c - t1, "calls_s": t2 - t1c,
            "per_call_s": (t2 - t1c) / len(indices)}


def _vcr_replay(path: Path, url: str, indices: list[int]) -> dict[str, float]:
    t0 = time.perf_counter()
    cm = w.vcr_instance("none").use_cassette(str(path))
    cm.__enter__()
    t1 = time.perf_counter()
    try:
        c = w.client(url)
        t1c = time.perf_counter()
        out = w.calls(c, indices)
        t2 = time.perf_counter()
    finally:
        cm.__exit__(None, None, None)
    w.check_echo(out, indices)
    return {"load_s": t1 - t0, "client_s": t1c - t1, "calls_s": t2 - t1c,
            "per_call_s": (t2 - t1c) / len(indices)}


def _summary(samples: list[dict[str, float]]) -> dict[str, Any]:
    return {
        "per_call_ms": w.ms(w.median([s["per_call_s"] for s in samples])),
        "load_ms": w.ms(w.median([s["load_s"] for s in samples])),
        "total_ms": w.ms(w.median([s["calls_s"] for s in samples])),
        "client_ms": w.ms(w.median([s["client_s"] for s in samples])),
        "samples_per_call_ms": [round(w.ms(s["per_call_s"]), 4) for s in samples],
        "repeats": len(samples),
    }


def run(*, small: int = 200, large: int = 2000, repeats: int = 5, vcr_repeats: int = 5,
        stride: int = 10, full_vcr: bool = False) -> dict[str, Any]:
    with w.measurement("replay"), w.tempdir("replay") as d:
        paths: dict[tuple[str, int], Path] = {}
        with w.stub() as server:
            url = server.url
            for n in (small, large):
                paths["deja", n] = _record_deja(url, n, d / f"deja-{n}.jsonl")
                w.assert_unpatched("after deja recording")
                paths["vcr", n] = _record_vcr(url, n, d / f"vcr-{n}.yaml")
                w.assert_unpatched("after vcrpy recording")
        # The stub is stopped: from here on nothing answers at `url`.

        _deja_replay(paths["deja", small], url, list(range(small)), small)  # warm-up
        deja: dict[int, list[dict[str, float]]] = {small: [], large: []}
        for _, order in w.rounds(repeats, [small, large]):
            for n in order:
                gc.collect()
                deja[n].append(_deja_replay(paths["deja", n], url, list(range(n)), n))
        w.assert_unpatched("after deja replays")

        vcr_small = []
        for _ in range(vcr_repeats):
            gc.collect()
            vcr_small.append(_vcr_replay(paths["vcr", small], url, list(range(small))))
        w.assert_unpatched("after vcrpy replays")
        sample = list(range(large)) if full_vcr else list(range(0, large, stride))
        gc.collect()
        vcr_large = [_vcr_replay(paths["vcr", large], url, sample)]
        w.assert_unpatched("after vcrpy replays")

        out: dict[str, Any] = {
            "small": small, "large": large,
            "deja": {str(small): _summary(deja[small]), str(large): _summary(deja[large])},
            "vcr": {str(small): _summary(vcr_small), str(large): _summary(vcr_large)},
            "vcr_large_calls_replayed": len(sample),
            "vcr_large_sampled": not full_vcr,
            "cassette_bytes": {f"{k}-{n}": p.stat().st_size for (k, n), p in paths.items()},
        }
        d_small = out["deja"][str(small)]["per_call_ms"]
        d_large = out["deja"][str(large)]["per_call_ms"]
        v_small = out["vcr"][str(small)]["per_call_ms"]
        v_large = out["vcr"][str(large)]["per_call_ms"]
        out["speedup_large"] = v_large / d_large
        out["speedup_small"] = v_small / d_small
        out["deja_scaling"] = d_large / d_small
        out["vcr_scaling"] = v_large / v_small
        return out
