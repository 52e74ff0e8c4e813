"""Replay cost per call: deja against agent-rewind, vcrpy and the SDK's own floor.

The workload is an agent's (:func:`workloads.agent_run`): conversations of
``workloads.CONV_TURNS`` calls whose history grows turn by turn, the model calling two tools
alternately, every request carrying the whole conversation so far; a run of N calls is N /
CONV_TURNS such conversations, so requests are the same size at every N and per-call cost
can only grow with N through the replayer's own lookup. It runs twice: JSON replies
(``messages.create``) and SSE (``messages.create(stream=True)``, every event iterated).

Each tool records the same workload against the same stub (same base URL, which vcrpy's
``uri`` matcher needs); the stub is stopped before any replay, so a request that escaped
replay would fail to connect.

- deja: ``replayer.replay(path)``: the SDK's real HTTP path, answered at httpx2's transport.
- agent-rewind: ``rewind.patch_anthropic()`` then ``rewind.replay(path)`` (strict matching,
  its default): ``Messages.create`` itself is replaced, the recorded reply revived into SDK
  types; no HTTP at all.
- vcrpy: ``use_cassette(path, record_mode="none", match_on=[method, uri, body])``.
- SDK floor: the same client with ``http_client=httpx2.Client(transport=MockTransport(...))``
  at the same base URL, answering the recorded responses in order from memory
  (:func:`workloads.floor_client`):
  request building, httpx2 and response parsing, with no matching and no storage. A replay
  through the SDK's HTTP path cannot beat it.

Per-call time = (time of N calls) / N, with a fresh client made inside the replay (its
construction timed apart). Load time (reading and verifying the cassette, installing
patches: the ``__enter__`` of the replay context) and finish time (its ``__exit__``: deja's
result, with what went unused and the recorded run's totals) are measured separately. deja,
agent-rewind and the floor: median of ``repeats`` replays per size, rounds rotated, after one
untimed warm-up each. vcrpy: median of ``vcr_repeats`` at the small size; at the large size
its matcher scans the interactions linearly for every call (O(N) per call), so by default it
replays every ``stride``-th conversation of the full cassette once, starting at stride / 2
(its cost per call grows linearly with the match's position, so conversations centred in
equal slices of the cassette estimate the full run's mean); ``full_vcr`` replays all.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import workloads as w

import recorder
import replayer

MODES = ("json", "sse")


def _timed(enter: Callable[[], Any], leave: Callable[[], None], make_client: Callable[[], Any],
           n: int, stream: bool, convs: list[int] | None = None) -> dict[str, float]:
    t0 = time.perf_counter()
    ctx = enter()
    t1 = time.perf_counter()
    try:
        c = make_client()
        t1c = time.perf_counter()
        done = w.agent_run(c, n, stream=stream, convs=convs)
        t2 = time.perf_counter()
    finally:
        leave()
    t3 = time.perf_counter()
    del ctx
    return {"load_s": t1 - t0, "client_s": t1c - t1, "calls_s": t2 - t1c,
            "per_call_s": (t2 - t1c) / done, "finish_s": t3 - t2}


def _deja(path: Path, url: str, n: int, stream: bool) -> dict[str, float]:
    cm = replayer.replay(path, raise_on_divergence=False)
    out = _timed(cm.__enter__, lambda: cm.__exit__(None, None, None), lambda: w.client(url),
                 n, stream)
    result = cm.result
    assert result is not None
    if result.divergence is not None:
        raise RuntimeError(f"deja replay diverged: {result.report()}")
    return out


def _rewind(path: Path, url: str, n: int, stream: bool) -> dict[str, float]:
    import rewind

    state: dict[str, Any] = {}

    def enter() -> Any:
        state["unpatch"] = rewind.patch_anthropic()
        state["cm"] = rewind.replay(path, require_full_consumption=True)
        return state["cm"].__enter__()

    def leave() -> None:
        try:
            state["cm"].__exit__(None, None, None)
        finally:
            state["unpatch"]()

    return _timed(enter, leave, lambda: w.client(url), n, stream)


def _vcr(path: Path, url: str, n: int, stream: bool,
         convs: list[int] | None = None) -> dict[str, float]:
    cm = w.vcr_instance("none").use_cassette(str(path))
    return _timed(cm.__enter__, lambda: cm.__exit__(None, None, None), lambda: w.client(url),
                  n, stream, convs)


def _floor(answers: list[Any], url: str, n: int, stream: bool) -> dict[str, float]:
    return _timed(lambda: None, lambda: None, lambda: w.floor_client(answers, url), n, stream)


def _summary(samples: list[dict[str, float]]) -> dict[str, Any]:
    return {
        "per_call_ms": w.ms(w.median([s["per_call_s"] for s in samples])),
        "load_ms": w.ms(w.median([s["load_s"] for s in samples])),
        "finish_ms": w.ms(w.median([s["finish_s"] for s in samples])),
        "total_ms": w.ms(w.median([s["calls_s"] for s in samples])),
        "client_ms": w.ms(w.median([s["client_s"] for s in samples])),
        "samples_per_call_ms": [round(w.ms(s["per_call_s"]), 4) for s in samples],
        "repeats": len(samples),
    }


def _record(d: Path, mode: str, sizes: tuple[int, int], have_rewind: bool
            ) -> tuple[str, dict[tuple[str, int], Path], dict[int, list[Any]]]:
    stream = mode == "sse"
    paths: dict[tuple[str, int], Path] = {}
    answers: dict[int, list[Any]] = {}
    with w.stub(w.agent_script(w.CONV_TURNS)) as server:
        url = server.url
        for n in sizes:
            paths["deja", n] = p = d / f"deja-{mode}-{n}.jsonl"
            with recorder.record(p, budgets=recorder.Budgets()):
                w.agent_run(w.client(url), n, stream=stream)
            w.assert_unpatched("after deja recording")
            paths["vcr", n] = p = d / f"vcr-{mode}-{n}.yaml"
            with w.vcr_instance("all").use_cassette(str(p)):
                w.agent_run(w.client(url), n, stream=stream)
            w.assert_unpatched("after vcrpy recording")
            if have_rewind:
                paths["rewind", n] = p = d / f"rewind-{mode}-{n}.rewind"
                with w.rewind_patched() as rw, rw.record(p):
                    w.agent_run(w.client(url), n, stream=stream)
                w.assert_unpatched("after agent-rewind recording")
            cap = w.Capture(url)
            try:
                w.agent_run(cap.client(), n, stream=stream)
            finally:
                cap.close()
            answers[n] = cap.responses
    return url, paths, answers


def _run_mode(d: Path, mode: str, small: int, large: int, repeats: int, vcr_repeats: int,
              stride: int, full_vcr: bool, have_rewind: bool) -> dict[str, Any]:
    stream = mode == "sse"
    url, paths, answers = _record(d, mode, (small, large), have_rewind)
    # The stub is stopped: from here on nothing answers at `url`.
    runners: dict[str, Callable[[int], dict[str, float]]] = {
        "deja": lambda n: _deja(paths["deja", n], url, n, stream),
        "floor": lambda n: _floor(answers[n], url, n, stream),
    }
    if have_rewind:
        runners["rewind"] = lambda n: _rewind(paths["rewind", n], url, n, stream)
    for run in runners.values():
        run(small)  # warm-up
    samples: dict[str, dict[int, list[dict[str, float]]]] = {
        k: {small: [], large: []} for k in runners}
    jobs = [(k, n) for n in (small, large) for k in runners]
    for _, order in w.rounds(repeats, jobs):
        for k, n in order:
            gc.collect()
            samples[k][n].append(runners[k](n))
    w.assert_unpatched(f"after {mode} replays")

    vcr_small = []
    for _ in range(vcr_repeats):
        gc.collect()
        vcr_small.append(_vcr(paths["vcr", small], url, small, stream))
    n_conv = large // w.CONV_TURNS
    # Centred sample: conversations stride/2, 3*stride/2, ... sit evenly over the cassette.
    convs = list(range(n_conv)) if full_vcr else list(range(stride // 2, n_conv, stride))
    gc.collect()
    vcr_large = [_vcr(paths["vcr", large], url, large, stream, convs)]
    w.assert_unpatched(f"after {mode} vcrpy replays")

    s, b = str(small), str(large)
    out: dict[str, Any] = {k: {s: _summary(v[small]), b: _summary(v[large])}
                           for k, v in samples.items()}
    out["vcr"] = {s: _summary(vcr_small), b: _summary(vcr_large)}
    out["vcr_large_calls_replayed"] = len(convs) * w.CONV_TURNS
    out["cassette_bytes"] = {f"{k}-{n}": p.stat().st_size for (k, n), p in paths.items()}
    per = {k: {n: out[k][n]["per_call_ms"] for n in (s, b)} for k in (*runners, "vcr")}
    out["ratio"] = {
        "floor": {n: per["deja"][n] / per["floor"][n] for n in (s, b)},
        "rewind": {n: per["deja"][n] / per["rewind"][n] for n in (s, b)} if have_rewind else None,
        "vcr_speedup": {n: per["vcr"][n] / per["deja"][n] for n in (s, b)},
        "scaling": {k: per[k][b] / per[k][s] for k in per},
    }
    return out


def run(*, small: int = 200, large: int = 2000, repeats: int = 5, vcr_repeats: int = 5,
        stride: int = 10, full_vcr: bool = False) -> dict[str, Any]:
    version = w.rewind_version()
    out: dict[str, Any] = {"small": small, "large": large, "conv_turns": w.CONV_TURNS,
                           "rewind_version": version, "vcr_large_sampled": not full_vcr}
    with w.measurement("replay"), w.tempdir("replay") as d:
        for mode in MODES:
            out[mode] = _run_mode(d, mode, small, large, repeats, vcr_repeats, stride,
                                  full_vcr, version is not None)
    return out
