"""Loading a large cassette, and the memory a long replay takes.

Load. An agent run is recorded once, through the real SDK against the stub server, until the
cassette has exactly ``lines`` lines (header and end line included): conversations of
``workloads.CONV_TURNS`` model calls whose history grows turn by turn, each tool_use reply
followed by the tool it names (``search`` / ``read_file``, decorated with ``@recorder.tool``,
returning :func:`workloads.tool_output`), so model and tool lines alternate as in a real
agent's cassette. ``recorder.cassette.load(path)`` (read, parse, verify the signature chain
of every line, restore compact fields) is then timed ``repeats`` times on the same file, after
a ``gc.collect()`` each; every load must say ``verified``. Anchors: the floor of any JSON-lines
reader (read the file, ``json.loads`` every line, nothing else), and agent-rewind's eager
``rewind.trace.Trace.load`` (and its lazy ``Trace.open``, which its replay uses) of the same
run recorded by agent-rewind in the same pass (``rewind.patch_anthropic()`` around
``Messages.create``, ``@rewind.tool`` under ``@recorder.tool``; its file holds every whole
request, as it does when it records alone). The loads rotate their order round by round;
agent-rewind's take part in the first ``rewind_repeats`` rounds. vcrpy is not an anchor
here: its YAML of 5,000 whole requests would take minutes to record and to load.

Memory. A run of ``calls`` calls (the replay rows' JSON workload, :func:`workloads.agent_run`)
is recorded, then replayed in a fresh interpreter (this module run as a script) so nothing
else this process holds counts: peak RSS once everything is imported, the client made and a
run of :data:`WARM_CALLS` calls replayed (which imports what a replay imports on its first
use: the HTTP libraries' patchers, about 15 MiB, the same for any cassette) is the baseline
("the interpreter"); the peak after the whole replay minus that baseline is what the replay
took. Peak RSS is the process's own high-water mark, ``VmHWM`` of
``/proc/self/status``: ``getrusage(RUSAGE_SELF).ru_maxrss`` of a child started with fork +
exec also counts the parent's peak (Linux carries the old image's high-water mark over
``exec``), so it is only the fallback where there is no ``/proc``, and is reported beside.
A second child, run beside the first, does the same under ``tracemalloc`` (started after the
baseline; its peak counts Python allocations only, not the allocator's slack or freed pages
the process keeps). Both also read their peak once the cassette is loaded, before any call.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import workloads as w

import recorder
import replayer

HERE = Path(__file__).resolve()


# ---------------------------------------------------------------------------- load


def _tools(with_rewind: bool) -> dict[str, Callable[..., str]]:
    """The agent's two tools, recorded by deja (and by agent-rewind under it)."""

    def search(query: str, task: int, call: int) -> str:
        return w.tool_output(task, call)

    def read_file(path: str, task: int, call: int) -> str:
        return w.tool_output(task, call)

    out: dict[str, Callable[..., str]] = {}
    for fn in (search, read_file):
        inner: Callable[..., str] = fn
        if with_rewind:
            import rewind

            inner = rewind.tool(fn)
        out[fn.__name__] = recorder.tool(inner)
    return out


def _agent(url: str, steps: int, tools: dict[str, Callable[..., str]]) -> tuple[int, int]:
    """Conversations of model calls, each tool_use answered by running the tool, until
    ``steps`` steps (model + tool calls) are made; returns (model calls, tool calls)."""
    c = w.client(url)
    model = tool = 0
    conv = 0
    while model + tool < steps:
        messages: list[dict[str, Any]] = [{"role": "user", "content": w.task_text(conv)}]
        for k in range(w.CONV_TURNS):
            if model + tool >= steps:
                break
            text, uses = w.agent_call(c, list(messages), stream=False)
            model += 1
            last = messages[-1]["content"]
            last_text = last if isinstance(last, str) else last[0]["content"]
            if text != f"ok {last_text}":
                raise RuntimeError(f"conversation {conv}, call {k}: unexpected reply {text!r}")
            messages.append({"role": "assistant",
                             "content": [{"type": "text", "text": text}, *uses]})
            if not uses or model + tool >= steps:
                continue
            use = uses[0]
            result = tools[use["name"]](*use["input"].values(), task=conv, call=k)
            tool += 1
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": use["id"], "content": result}]})
        conv += 1
    return model, tool


def _record_load_run(d: Path, lines: int, with_rewind: bool) -> tuple[Path, Path | None,
                                                                        dict[str, int]]:
    path = d / "load.jsonl"
    rw_path = d / "load.rewind" if with_rewind else None
    tools = _tools(with_rewind)
    with w.stub(w.agent_script(w.CONV_TURNS)) as server:
        t0 = time.perf_counter()
        with recorder.record(path, budgets=recorder.Budgets()):
            if rw_path is not None:
                with w.rewind_patched() as rw, rw.record(rw_path):
                    model, tool = _agent(server.url, lines - 2, tools)
            else:
                model, tool = _agent(server.url, lines - 2, tools)
        record_s = time.perf_counter() - t0
    w.assert_unpatched("after recording the load cassette")
    n = len(path.read_bytes().splitlines())
    if n != lines:
        raise RuntimeError(f"the load cassette has {n} lines, not {lines}: the recorder writes "
                           "lines besides header, steps and end; adjust _agent")
    return path, rw_path, {"model_calls": model, "tool_calls": tool,
                           "record_ms": round(w.ms(record_s))}


def _times(fn: Callable[[], Any], repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        gc.collect()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _stats(times: list[float]) -> dict[str, Any]:
    return {"median_ms": w.ms(w.median(times)), "min_ms": w.ms(min(times)),
            "samples_ms": [round(w.ms(t), 2) for t in times]}


def _deja_load(path: Path, lines: int) -> None:
    cas = recorder.cassette.load(path)
    if not cas.verified:
        raise RuntimeError(f"{path} loaded unverified: {cas.verify_note}")
    if len(cas.observations) != lines - 2 or cas.end is None:
        raise RuntimeError(f"{path}: {len(cas.observations)} observations, expected {lines - 2}")


def _json_floor(path: Path) -> None:
    for line in path.read_bytes().splitlines():
        json.loads(line)


def run_load(*, lines: int = 10_000, repeats: int = 5, rewind_repeats: int = 3) -> dict[str, Any]:
    """``rewind_repeats=0`` leaves agent-rewind out (recording its file too roughly doubles
    the time this takes)."""
    version = w.rewind_version()
    with w.measurement("load"), w.tempdir("load") as d:
        path, rw_path, made = _record_load_run(d, lines,
                                               version is not None and rewind_repeats > 0)
        _deja_load(path, lines)  # warm-up, untimed
        jobs: dict[str, Callable[[], Any]] = {"deja": lambda: _deja_load(path, lines),
                                              "json_floor": lambda: _json_floor(path)}
        events = 0
        if rw_path is not None:
            from rewind.trace import Trace

            events = len(Trace.load(rw_path))  # warm-up, and the check
            if events != made["model_calls"] + made["tool_calls"]:
                raise RuntimeError(f"agent-rewind recorded {events} events, expected "
                                   f"{made['model_calls'] + made['tool_calls']}")
            jobs["rewind_load"] = lambda: Trace.load(rw_path)
            jobs["rewind_open"] = lambda: Trace.open(rw_path)
        samples: dict[str, list[float]] = {k: [] for k in jobs}
        for n, order in w.rounds(repeats, list(jobs)):
            for k in order:
                if not k.startswith("rewind") or n < rewind_repeats:
                    samples[k] += _times(jobs[k], 1)
        out: dict[str, Any] = {
            "lines": lines, "bytes": path.stat().st_size, "repeats": repeats, **made,
            "conv_turns": w.CONV_TURNS, "deja": _stats(samples["deja"]),
            "json_floor": _stats(samples["json_floor"]), "rewind_version": version,
            "rewind_skipped": rewind_repeats <= 0}
        if rw_path is not None:
            out["rewind"] = {"bytes": rw_path.stat().st_size, "events": events,
                             "load": _stats(samples["rewind_load"]),
                             "open": _stats(samples["rewind_open"]),
                             "repeats": len(samples["rewind_load"])}
    out["per_line_us"] = out["deja"]["median_ms"] * 1000 / lines
    return out


# ---------------------------------------------------------------------------- memory


def _peak_rss() -> tuple[int, str]:
    """This process's own peak RSS in bytes, and where it came from."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024, "VmHWM"
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "ru_maxrss"


WARM_CALLS = w.CONV_TURNS  # the calls of the run replayed before the baseline is read


def _child(path: str, url: str, calls: int, traced: bool) -> dict[str, Any]:
    """In a fresh interpreter: a short replay (``path`` with ``.warm`` before its suffix),
    baseline peak RSS, then the replay (peak once the cassette is loaded, and at the end),
    under tracemalloc if ``traced``."""
    c = w.client(url)
    with replayer.replay(Path(path).with_suffix(".warm.jsonl"), raise_on_divergence=False):
        w.agent_run(c, WARM_CALLS)
    gc.collect()
    base, source = _peak_rss()
    base_maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if traced:
        tracemalloc.start()
    t0 = time.perf_counter()
    with replayer.replay(path, raise_on_divergence=False) as session:
        loaded, _ = _peak_rss()
        traced_loaded = tracemalloc.get_traced_memory()[1] if traced else None
        w.agent_run(c, calls)
    replay_s = time.perf_counter() - t0
    traced_peak = tracemalloc.get_traced_memory()[1] if traced else None
    peak, _ = _peak_rss()
    peak_maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result = session.result
    if result is None or result.divergence is not None:
        raise RuntimeError(f"replay diverged: {result.report() if result else 'no result'}")
    return {"baseline_bytes": base, "loaded_bytes": loaded, "peak_bytes": peak,
            "source": source, "ru_maxrss_baseline_bytes": base_maxrss,
            "ru_maxrss_peak_bytes": peak_maxrss, "traced_loaded_bytes": traced_loaded,
            "traced_peak_bytes": traced_peak, "replay_s": replay_s}


def _children(path: Path, url: str, calls: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The RSS child and the tracemalloc child, run side by side (neither one's memory is
    the other's; only their times, which these rows do not judge, share the CPUs)."""
    procs = [subprocess.Popen(
        [sys.executable, str(HERE), "memory-child", str(path), url, str(calls), mode],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=HERE.parent,
        env=dict(os.environ)) for mode in ("rss", "traced")]
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"the memory child failed ({proc.returncode}): "
                               f"{stderr.strip()[-2000:]}")
        out.append(dict(json.loads(stdout.strip().splitlines()[-1])))
    return out[0], out[1]


def run_memory(*, calls: int = 2000) -> dict[str, Any]:
    with w.measurement("memory"), w.tempdir("memory") as d:
        path = d / "memory.jsonl"
        with w.stub(w.agent_script(w.CONV_TURNS)) as server:
            url = server.url
            with recorder.record(path, budgets=recorder.Budgets()):
                w.agent_run(w.client(url), calls)
            with recorder.record(path.with_suffix(".warm.jsonl"), budgets=recorder.Budgets()):
                w.agent_run(w.client(url), WARM_CALLS)
        w.assert_unpatched("after recording the memory cassette")
        # The stub is stopped: the children's replays must be served from the cassette.
        rss, traced = _children(path, url, calls)
        size = path.stat().st_size
    used = rss["peak_bytes"] - rss["baseline_bytes"]
    return {"calls": calls, "conv_turns": w.CONV_TURNS, "warm_calls": WARM_CALLS,
            "bytes": size, "rss": rss,
            "traced": traced, "rss_over_baseline_bytes": used,
            "rss_loaded_over_baseline_bytes": rss["loaded_bytes"] - rss["baseline_bytes"],
            "ratio_rss": used / size, "ratio_traced": traced["traced_peak_bytes"] / size}


if __name__ == "__main__":
    if len(sys.argv) != 6 or sys.argv[1] != "memory-child":
        sys.exit(f"usage: {HERE.name} memory-child CASSETTE URL CALLS rss|traced "
                 "(run by bench/run.py)")
    print(json.dumps(_child(sys.argv[2], sys.argv[3], int(sys.argv[4]),
                            sys.argv[5] == "traced")))
