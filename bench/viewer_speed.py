"""Rows 5-6: the viewer's first paint of a long run, and the runs-table filter over many runs.

First paint: one run of ``steps`` steps (half model calls through the real anthropic SDK
against the stub server, half ``@recorder.tool`` calls; ``budgets=recorder.Budgets()`` and
``loop_guard=False`` lift the default turn budget and loop guard) is indexed, ``deja view``
serves its directory on 127.0.0.1, and headless Chromium (Debian's /usr/bin/chromium,
driven by Playwright) opens ``/?run=<id>``. A load is timed by the page's own clock
(``performance.now()``, whose origin is the start of the navigation), checked every
animation frame, until the timeline is drawn: its canvas (Glide Data Grid) has text in
its first data row. The grid fills the table it keeps beside the canvas for screen
readers later, once the charts below are drawn; the time until that table holds all the
rows (``aria-rowcount`` = steps + 1) is kept too, and confirms that the grid drawn is the
whole timeline. Each load is a new browser context (empty cache, new Streamlit session)
holding the viewer's cookie, as after opening the address ``deja view`` printed; one
untimed load comes first (the server's first session).

Filter: ``runs`` small signed cassettes (a model step with its request and response, a
tool step, an end line) are written with ``recorder.cassette.CassetteWriter`` directly,
as recording each through the SDK would take too long, by one forked process per CPU,
into a tmpfs folder when there is one (``/dev/shm``: their fsync at close costs
nothing there); statuses, models, tools, token counts and texts vary by run. The real
indexer reads and verifies every one of them once (timed, informative); then
``viewer.queries.list_runs`` runs with a status filter plus a full-text search (the
runs table's query), median of ``repeats``.
"""

from __future__ import annotations

import http.client
import itertools
import multiprocessing
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import workloads as w

import recorder
from recorder.canonical import digest
from recorder.cassette import CassetteWriter, load
from recorder.cassette.keys import load_keyring, require_signing_key
from recorder.launch import new_run_id
from viewer import queries
from viewer.guard import COOKIE, cookie_value
from viewer.index import RunIndex

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]
NEEDLE = "refresh_token"  # in the tool result of one run in NEEDLE_EVERY
NEEDLE_EVERY = 100
STATUSES = ("completed",) * 7 + ("stopped", "exhausted", "cancelled")
MODELS = ("claude-sonnet-4-6", "claude-haiku-4-5", "claude-opus-4-5")
TOOLS = ("search", "read_file", "weather", "run_tests")


# ---------------------------------------------------------------------- first paint


def hits(i: int) -> str:
    return f"row {i}: {i * 7 % 23} hits"


@recorder.tool
def lookup(i: int) -> str:
    return hits(i)


def record_long_run(folder: Path, steps: int) -> tuple[Path, str]:
    """``steps`` steps: model call, tool call, model call, ... through the real SDK."""
    path = folder / "long.jsonl"
    with w.stub() as server:
        c = w.client(server.url)
        with recorder.record(path, budgets=recorder.Budgets(), loop_guard=False) as rec:
            for i in range(steps // 2):
                w.call(c, i)
                lookup(i)
            run = rec.run_id
        c.close()
    return path, run


def write_long_run(folder: Path, steps: int) -> tuple[Path, str]:
    """``steps`` steps as :func:`record_long_run` makes them (a model call, then a tool
    call), written line by line with the cassette writer, signed: recording a hundred
    thousand steps through the SDK would take minutes."""
    path = folder / "long.jsonl"
    run = new_run_id()
    header = {"run": run, "parent": None, "created": "2026-01-01T00:00:00.000Z",
              "argv": ["python", "agent.py"], "cwd": ".", "entry": None, "labels": {},
              "fsync": "exit"}
    writer = CassetteWriter(path, header, require_signing_key(load_keyring(create=False)),
                            "exit")
    t = datetime(2026, 1, 1, tzinfo=UTC).timestamp()
    for i in range(steps // 2):
        request = {"max_tokens": w.MAX_TOKENS, "model": w.MODEL,
                   "messages": [{"role": "user", "content": w.prompt(i)}]}
        body = {"id": f"msg_{i:08d}", "type": "message", "role": "assistant",
                "model": w.MODEL, "content": [{"type": "text", "text": f"ok {i}"}],
                "stop_reason": "end_turn", "stop_sequence": None,
                "usage": {"input_tokens": 20, "output_tokens": 5}}
        writer.append({"kind": "model", "url": "http://127.0.0.1:8765/v1/messages",
                       "request_headers": [["content-type", "application/json"]],
                       "t": round(t, 3), "ms": 3.0, "cost_usd": 0.000135,
                       "response": {"status": 200, "body_json": body,
                                    "headers": [["content-type", "application/json"]]}},
                      request_body=request, has_request=True)
        args = {"i": i}
        writer.append({"kind": "tool", "name": "lookup", "args": args, "ms": 0.1,
                       "fp": digest(["tool", "lookup", args]), "t": round(t + 0.003, 3),
                       "result": hits(i)})
        t += 0.004
    writer.close({"status": "completed", "totals": {}})
    return path, run


def _memory(pid: int) -> dict[str, float]:
    """The resident memory of process ``pid`` now and at its peak, in MiB (Linux)."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0]) / 1024
    return {"rss_mib": round(fields["VmRSS"], 1), "peak_rss_mib": round(fields["VmHWM"], 1)}


def _child(pid: int) -> int:
    """The one child of ``pid``: the Streamlit server ``deja view`` runs."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    if len(children) != 1:
        raise RuntimeError(f"deja view ({pid}) has children {children}, not one server")
    return int(children[0])


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _healthy(port: int) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        conn.request("GET", "/_stcore/health")
        return conn.getresponse().read() == b"ok"
    except OSError:
        return False
    finally:
        conn.close()


@contextmanager
def viewer(folder: Path, log: Path) -> Iterator[tuple[str, str, int]]:
    """``deja view FOLDER`` on a free port until the block ends: its base URL, the token
    of the address it printed and the process id of its Streamlit server."""
    port = _free_port()
    with log.open("wb") as sink:
        process = subprocess.Popen([sys.executable, "-m", "deja", "view", str(folder),
                                    "--port", str(port)], stdout=sink,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 60
            while not _healthy(port):
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"deja view did not start: {log.read_text()}")
                time.sleep(0.2)
            printed = re.search(r"/\?token=(\S+) ", log.read_text())
            if printed is None:
                raise RuntimeError(f"deja view printed no token: {log.read_text()}")
            yield f"http://127.0.0.1:{port}", printed.group(1), _child(process.pid)
        finally:
            process.terminate()
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


# The timeline is the run page's first dataframe: a canvas (Glide Data Grid). It counts as
# rendered at the first frame where its first data row (below the 35 px header) has text
# drawn in it (dark pixels). Its accessible table, which the grid fills later, confirms the
# row count afterwards.
_PAINTED = """() => {
    const canvas = document.querySelector('[data-testid="stDataFrame"] canvas');
    if (!canvas || canvas.width === 0) return null;
    const r = window.devicePixelRatio || 1;
    const band = canvas.getContext('2d').getImageData(
        0, Math.round(40 * r), Math.min(canvas.width, Math.round(300 * r)), Math.round(25 * r));
    for (let i = 0; i < band.data.length; i += 4) {
        const d = band.data;
        if (d[i + 3] > 0 && d[i] < 120 && d[i + 1] < 120 && d[i + 2] < 120)
            return performance.now();
    }
    return null;
}"""
_GRID = """rows => {
    const grid = document.querySelector(
        '[data-testid="stDataFrame"] table[aria-rowcount="' + rows + '"]');
    return grid && grid.querySelector('td') ? performance.now() : null;
}"""


def _load(page: Any, url: str, rows: int, timeout_ms: int) -> tuple[float, float]:
    """Seconds from the navigation's start until the timeline's rows are drawn, and until
    its accessible table holds all ``rows`` (header included)."""
    page.goto(url, wait_until="commit")
    painted = page.wait_for_function(_PAINTED, polling="raf", timeout=timeout_ms)
    grid = page.wait_for_function(_GRID, arg=rows, polling="raf", timeout=timeout_ms)
    return float(painted.json_value()) / 1000.0, float(grid.json_value()) / 1000.0


def first_paint(steps: int, loads: int, timeout_ms: int = 120_000, *,
                written: bool = False) -> dict[str, Any]:
    """First paint of a ``steps``-step run, recorded through the SDK (or ``written`` with
    the cassette writer), over ``loads`` loads after an untimed one."""
    if not CHROMIUM.exists():
        raise RuntimeError(f"{CHROMIUM} is missing: `make chromium` (or `make test`) installs "
                           "Debian's chromium; Playwright never downloads a browser")
    from playwright.sync_api import sync_playwright

    with w.tempdir("viewer-paint") as d:
        folder = d / "runs"
        folder.mkdir()
        t0 = time.perf_counter()
        path, run = (write_long_run if written else record_long_run)(folder, steps)
        record_s = time.perf_counter() - t0
        run_bytes = path.stat().st_size
        t0 = time.perf_counter()
        with RunIndex(folder) as index:
            stats = index.refresh()
            indexed_steps = len(queries.run_steps(index, run))
        index_s = time.perf_counter() - t0
        if stats["errors"] or indexed_steps != steps:
            raise RuntimeError(f"index of the long run: {stats}, {indexed_steps} steps")
        url = f"/?run={run}"
        painted: list[float] = []
        grids: list[float] = []
        with viewer(folder, d / "view.log") as (base, token, server), sync_playwright() as p:
            idle = _memory(server)
            browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                                        args=CHROMIUM_ARGS)
            try:
                for i in range(loads + 1):  # the first load is untimed: the server's first
                    context = browser.new_context(viewport={"width": 1280, "height": 800})
                    context.add_cookies([{"name": COOKIE, "value": cookie_value(token),
                                          "url": base}])
                    try:
                        paint, grid = _load(context.new_page(), base + url, steps + 1,
                                            timeout_ms)
                    finally:
                        context.close()
                    if i == 0:
                        first = paint
                    else:
                        painted.append(paint)
                        grids.append(grid)
            finally:
                browser.close()
            memory = {"idle_rss_mib": idle["rss_mib"], **_memory(server)}
    return {"steps": steps, "written": written, **memory, "run_bytes": run_bytes,
            "record_s": round(record_s, 2),
            "index_s": round(index_s, 3), "first_load_s": round(first, 3), "loads": loads,
            "paint_s": [round(x, 3) for x in painted], "grid_s": [round(x, 3) for x in grids],
            "median_s": round(statistics.median(painted), 3),
            "grid_median_s": round(statistics.median(grids), 3)}


# ---------------------------------------------------------------------- filter


def _run_lines(i: int, started: datetime) -> tuple[dict[str, Any], list[tuple[dict, Any]],
                                                      dict[str, Any]]:
    """Header, (line, request body) of each step, and the end of synthetic run ``i``."""
    model = MODELS[i % len(MODELS)]
    tool = TOOLS[i % len(TOOLS)]
    status = STATUSES[i % len(STATUSES)]
    question = f"run {i}: look into ticket T-{i * 37 % 10007} and report what you find"
    args = {"query": f"ticket T-{i * 37 % 10007}"}
    result = (f"found auth/session.py: def {NEEDLE}(self) in run {i}"
              if i % NEEDLE_EVERY == 0 else f"{i % 13} matches for ticket T-{i * 37 % 10007}")
    tokens_in, tokens_out = 200 + i % 1800, 20 + i % 180
    request = {"max_tokens": 1024, "messages": [{"role": "user", "content": question}],
               "model": model}
    body = {"id": f"msg_{i:08d}", "type": "message", "role": "assistant", "model": model,
            "content": [{"type": "text", "text": f"Looking into it ({i})."},
                        {"type": "tool_use", "id": f"toolu_{i:08d}", "name": tool,
                         "input": args}],
            "stop_reason": "tool_use", "stop_sequence": None,
            "usage": {"input_tokens": tokens_in, "output_tokens": tokens_out,
                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}
    t = started.timestamp()
    model_line = {"kind": "model", "url": "http://127.0.0.1:8765/v1/messages",
                  "request_headers": [["content-type", "application/json"],
                                      ["authorization", "[redacted]"]],
                  "t": round(t, 3), "ms": 250.0 + i % 500,
                  "response": {"status": 200,
                               "headers": [["content-type", "application/json"]],
                               "body_json": body},
                  "cost_usd": round(tokens_in * 3e-6 + tokens_out * 15e-6, 8)}
    tool_line = {"kind": "tool", "name": tool, "args": args,
                 "fp": digest(["tool", tool, args]), "t": round(t + 0.3, 3), "ms": 4.0,
                 "result": result}
    header = {"run": new_run_id()[:-8] + f"{i:08x}", "parent": None,
              "created": started.strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z",
              "argv": ["python", "agent.py"], "cwd": ".", "entry": None,
              "labels": {"case": f"bench-{i % 10}"}, "fsync": "turn"}
    end = {"status": status, "totals": {
        "model_calls": 1, "http_calls": 0, "tool_calls": 1, "effects": 0,
        "input_tokens": tokens_in, "output_tokens": tokens_out,
        "cost_usd": model_line["cost_usd"], "errors": 0, "duration_s": 0.35,
        "observations": 2}}
    return header, [(model_line, request), (tool_line, None)], end


def _write_range(folder: Path, start: int, stop: int) -> None:
    key = require_signing_key(load_keyring(create=False))
    base = datetime(2026, 1, 1, tzinfo=UTC)
    for i in range(start, stop):
        header, steps, end = _run_lines(i, base + timedelta(minutes=i))
        writer = CassetteWriter(folder / f"run-{i:05d}.jsonl", header, key, "exit")
        for line, request in steps:
            writer.append(line, request_body=request, has_request=request is not None)
        writer.close(end)


def write_runs(folder: Path, runs: int) -> int:
    """``runs`` signed cassettes in ``folder``, written by one forked process per CPU (the
    writer is CPU-bound Python); returns how many processes wrote them."""
    procs = min(os.cpu_count() or 1, 4) if runs >= 1000 else 1
    if procs == 1 or "fork" not in multiprocessing.get_all_start_methods():
        _write_range(folder, 0, runs)
        return 1
    bounds = [runs * k // procs for k in range(procs + 1)]
    with multiprocessing.get_context("fork").Pool(procs) as pool:
        pool.starmap(_write_range, [(folder, a, b) for a, b in itertools.pairwise(bounds)])
    return procs


@contextmanager
def _scratch(name: str) -> Iterator[Path]:
    """A temporary folder in memory (tmpfs) when there is one: the cassettes' fsync at
    close is then free, and a many-run folder is written in seconds, not minutes."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        with tempfile.TemporaryDirectory(prefix=f"deja-bench-{name}-", dir=shm) as d:
            yield Path(d)
    else:
        with w.tempdir(name) as d:
            yield d


def runs_filter(runs: int, repeats: int) -> dict[str, Any]:
    with _scratch("viewer-filter") as d:
        folder = d / "runs"
        folder.mkdir()
        t0 = time.perf_counter()
        writers = write_runs(folder, runs)
        write_s = time.perf_counter() - t0
        sample = load(folder / "run-00000.jsonl", keyring=load_keyring(create=False),
                      require_signature=True)
        if not sample.verified or sample.end is None or sample.end["status"] != "completed":
            raise RuntimeError("a written cassette does not verify")
        with RunIndex(folder) as index:
            t0 = time.perf_counter()
            stats = index.refresh()
            index_s = time.perf_counter() - t0
            if stats["errors"] or stats["indexed"] != runs:
                raise RuntimeError(f"index of {runs} runs: {stats}")
            t0 = time.perf_counter()
            again = index.refresh()
            refresh_s = time.perf_counter() - t0

            def timed(**filters: Any) -> tuple[float, int]:
                times, count = [], 0
                for _ in range(repeats):
                    t = time.perf_counter()
                    count = len(queries.list_runs(index, **filters))
                    times.append(time.perf_counter() - t)
                return statistics.median(times), count

            filtered_s, hits = timed(status=["completed"], text=NEEDLE.upper())
            expected = sum(1 for i in range(0, runs, NEEDLE_EVERY)
                           if STATUSES[i % len(STATUSES)] == "completed")
            if hits != min(expected, 500):
                raise RuntimeError(f"filter found {hits} runs, expected {expected}")
            all_s, listed = timed()
            many_s, many = timed(tool=["search"], model=[MODELS[0]], min_tokens=1000,
                                 since="2026-01-02")
    return {"runs": runs, "write_s": round(write_s, 2), "writers": writers,
            "in_memory": str(d).startswith("/dev/shm"), "index_s": round(index_s, 2),
            "refresh_unchanged_s": round(refresh_s, 3), "unchanged": again["unchanged"],
            "repeats": repeats, "filter_ms": round(w.ms(filtered_s), 2), "filter_hits": hits,
            "all_ms": round(w.ms(all_s), 2), "all_rows": listed,
            "combined_ms": round(w.ms(many_s), 2), "combined_rows": many}


def run(steps: int = 10_000, loads: int = 5, runs: int = 100_000, repeats: int = 7,
        small_steps: int | None = None, huge_steps: int | None = None) -> dict[str, Any]:
    """First paint of a ``steps``-step run (and of a ``small_steps``-step one and a
    written ``huge_steps``-step one, when given), then the runs-table filter over ``runs``
    runs."""
    os.environ.pop("ANTHROPIC_BASE_URL", None)
    out: dict[str, Any] = {}
    if small_steps:
        with w.measurement("viewer, shorter run"):
            out["paint_small"] = first_paint(small_steps, loads)
    with w.measurement("viewer"):
        out["paint"] = first_paint(steps, loads)
    if huge_steps:
        with w.measurement("viewer, longest run"):
            out["paint_huge"] = first_paint(huge_steps, loads, written=True)
    with w.measurement("viewer filter"):
        out["filter"] = runs_filter(runs, repeats)
    return out
