"""deja benchmarks: ``python bench/run.py [--quick] [--only NAME ...] [--full-vcr]``.

Prints one table (metric | deja | anchor | target | result) and writes
``bench/results/latest.json``. Everything runs offline against a stub Anthropic server on
127.0.0.1 with the real anthropic SDK. The anchors: vcrpy, agent-rewind (the ``bench`` extra,
which ``make bench`` installs; without it its cells say so) and the SDK's own floor (the same
calls answered from memory by an in-process ``httpx2.MockTransport``). Every value is a
median of several samples taken in this run; ratios are computed from medians of this run.
Exits 0 whatever the results: benchmarks are not tests; failed targets are printed as FAIL.

Measurements (``--only`` names): replay, overhead, ttft, size, resume, load (loading a
10,000-line cassette), memory (peak memory of a 2,000-call replay), viewer (the viewer's
first paint in headless Chromium, which needs Debian's chromium: ``make chromium``), proxy
(what ``deja proxy`` adds to a call, at 1, 32 and 200 concurrent clients, on a paced stream,
its throughput frontier and memory, each beside a bare forwarder on the same server stack),
openai (replay per call of the openai SDK's Chat Completions and Responses, JSON and
streamed, beside the anthropic SDK's), runs (``POST /runs`` to a run id with the embedded
SQLite default and with Postgres, beside the engine's own enqueue, and ``deja submit`` as a
fresh process), suite (``deja suite`` over 100 unchanged incidents, inline and on a ``deja
worker``).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import platform
import secrets
import shutil
import sys
import tempfile
import time
import traceback
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results" / "latest.json"
NAMES = ("replay", "openai", "overhead", "ttft", "size", "resume", "load", "memory", "viewer",
         "proxy", "runs", "suite")

# No real home is touched: a throwaway DEJA_HOME and signing key for this process.
_HOME = tempfile.mkdtemp(prefix="deja-bench-home-")
atexit.register(shutil.rmtree, _HOME, ignore_errors=True)
os.environ["DEJA_HOME"] = _HOME
os.environ["DEJA_KEY"] = "bench-" + secrets.token_hex(16)
os.environ.pop("DEJA_OLD_KEYS", None)
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import cassette_size  # noqa: E402
import load_speed  # noqa: E402
import openai_replay  # noqa: E402
import proxy_speed  # noqa: E402
import record_overhead  # noqa: E402
import replay_speed  # noqa: E402
import resume_speed  # noqa: E402
import runs_submit  # noqa: E402
import suite_speed  # noqa: E402
import ttft  # noqa: E402
import viewer_speed  # noqa: E402

Row = tuple[str, str, str, str, str]  # metric, deja, anchor, target, result


def _verdict(ok: bool, detail: str = "") -> str:
    return ("PASS" if ok else "FAIL") + (f" ({detail})" if detail else "")


def _fmt_ms(x: float) -> str:
    return f"{x:.3f} ms" if x < 10 else f"{x:.1f} ms"


def _finish(summary: dict[str, Any]) -> str:
    """``, finish X ms`` of a replay's summary (none in a result saved before it was
    measured)."""
    return f", finish {_fmt_ms(summary['finish_ms'])}" if "finish_ms" in summary else ""


def _kb(n: int) -> str:
    return f"{n / 1024:,.1f} KiB" if n < 1024 * 1024 else f"{n / 1024 / 1024:,.2f} MiB"


# ---------------------------------------------------------------------------- rows


def rows_replay(r: dict[str, Any]) -> tuple[list[Row], list[str], list[str]]:
    s, big = str(r["small"]), str(r["large"])
    have_rw = r["rewind_version"] is not None
    rows: list[Row] = []
    fails: list[str] = []
    for mode, label in (("json", "JSON"), ("sse", "SSE")):
        m = r[mode]
        d, v, fl, ratio = m["deja"], m["vcr"], m["floor"], m["ratio"]
        for n in (s, big):
            checks = [ratio["floor"][n] <= 1.1]
            detail = [f"{ratio['floor'][n]:.2f}x floor"]
            target = ["<= 1.1x floor"]
            anchors = [f"floor {_fmt_ms(fl[n]['per_call_ms'])}"]
            if have_rw:  # shown beside: it skips the SDK's HTTP path, which deja goes through
                rw = m["rewind"]
                detail.append(f"{ratio['rewind'][n]:.2f}x agent-rewind")
                anchors.insert(0, f"agent-rewind {_fmt_ms(rw[n]['per_call_ms'])} "
                                  f"(load {_fmt_ms(rw[n]['load_ms'])}"
                                  f"{_finish(rw[n])})")
            else:
                anchors.insert(0, "agent-rewind: not installed")
            sampled = (f", {m['vcr_large_calls_replayed']} calls sampled"
                       if n == big and r["vcr_large_sampled"] else "")
            anchors.append(f"vcrpy {_fmt_ms(v[n]['per_call_ms'])} "
                           f"({ratio['vcr_speedup'][n]:.0f}x slower{sampled})")
            if mode == "json" and n == big:
                checks.append(ratio["vcr_speedup"][n] >= 30)
                detail.append(f"{ratio['vcr_speedup'][n]:.0f}x vcrpy")
                target.append(">= 30x faster than vcrpy")
            ok = all(checks)
            rows.append((f"Replay per call, {label}, @{n} calls",
                         f"{_fmt_ms(d[n]['per_call_ms'])} (load {_fmt_ms(d[n]['load_ms'])}"
                         f"{_finish(d[n])})",
                         "; ".join(anchors), ", ".join(target), _verdict(ok, ", ".join(detail))))
            if not ok:
                fails.append(f"replay {label} @{n}: deja {_fmt_ms(d[n]['per_call_ms'])} per call"
                             f" = {', '.join(detail)}")
        sc = ratio["scaling"]
        scale_ok = sc["deja"] <= 1.1
        rows.append((f"Replay per call, {label}, @{big} / @{s}", f"{sc['deja']:.2f}x",
                     (f"agent-rewind {sc['rewind']:.2f}x; " if have_rw else "")
                     + f"floor {sc['floor']:.2f}x; vcrpy {sc['vcr']:.1f}x",
                     "<= 1.1x", _verdict(scale_ok, f"{sc['deja']:.2f}x")))
        if not scale_ok:
            fails.append(f"replay {label}: deja per call grows {sc['deja']:.2f}x from {s} to "
                         f"{big} calls")
    j = r["json"]
    k = j["vcr_large_calls_replayed"] // r["conv_turns"]
    vcr_small = (f"vcrpy @{s}: all {s} calls replayed once" if j["vcr"][s]["repeats"] == 1
                 else f"vcrpy @{s}: median of {j['vcr'][s]['repeats']} replays of all {s} calls")
    vcr_big = ((f"vcrpy @{big}: only {k} whole conversation{'s' if k > 1 else ''} of "
                f"{r['conv_turns']} calls replayed ({j['vcr_large_calls_replayed']} of {big} "
                + ("calls, the conversation in the middle of the cassette" if k == 1 else
                   f"calls, one centred in each of {k} equal slices of the cassette")
                + "), once, from the whole cassette loaded; its per call is the mean over those "
                "calls, which estimates the full run's because its matcher's cost grows "
                "linearly with the match's position (--full-vcr replays all)")
               if r["vcr_large_sampled"] else f"vcrpy @{big}: all {big} calls replayed once")
    notes = [
        f"replay: agent workload, conversations of {r['conv_turns']} calls whose history grows "
        f"turn by turn (search and read_file tool calls alternating, each request carries the "
        f"whole conversation, tool definitions included), {int(s) // r['conv_turns']} and "
        f"{int(big) // r['conv_turns']} conversations; JSON = messages.create, SSE = "
        "messages.create(stream=True) with every event iterated and the reply assembled. "
        "Per call = (time of N calls)/N with a fresh client made inside the replay "
        f"(construction, {_fmt_ms(j['deja'][s]['client_ms'])}, timed apart); load (read, "
        "verify, install patches) and finish (leaving the replay: deja's result, with what "
        "went unused and the recorded run's totals) excluded and shown. deja, agent-rewind "
        "and floor: median of "
        f"{j['deja'][s]['repeats']} replays per size, rounds rotated; {vcr_small}; {vcr_big}; "
        "JSON and SSE alike. Ratios use per-call medians.",
        "replay anchors: agent-rewind "
        + (r["rewind_version"] or "not installed (make bench installs .[bench])")
        + " = rewind.patch_anthropic() + rewind.replay(path) (strict matching): it replaces "
        "Messages.create and revives the stored reply into SDK types, so it skips the SDK's "
        "HTTP path altogether; SDK floor = the same client with http_client=httpx2.Client("
        "transport=httpx2.MockTransport(...)) answering the recorded response bytes in order "
        "from memory (request building, httpx2, response parsing; no lookup, no storage). "
        "deja answers at httpx2's transport, inside the SDK's HTTP path, so the floor bounds it "
        "from below; agent-rewind is not bound by it."]
    return rows, notes, fails


def rows_openai(r: dict[str, Any]) -> tuple[list[Row], list[str], list[str]]:
    n = r["calls"]
    rows: list[Row] = []
    fails: list[str] = []
    for key, api in (("openai", "Chat Completions"), ("responses", "Responses")):
        for mode, label in (("json", "JSON"), ("sse", "streamed")):
            m = r[mode]
            ratio = m["ratio"][f"{key}_floor"]
            ok = ratio <= 1.2
            rows.append((f"Replay per call, OpenAI {api} {label}, @{n} calls",
                         f"{_fmt_ms(m[key]['per_call_ms'])} "
                         f"(load {_fmt_ms(m[key]['load_ms'])})",
                         f"openai SDK floor {_fmt_ms(m[f'{key}_floor']['per_call_ms'])}; "
                         f"Anthropic in the same rounds: deja "
                         f"{_fmt_ms(m['anthropic']['per_call_ms'])}, floor "
                         f"{_fmt_ms(m['anthropic_floor']['per_call_ms'])} "
                         f"({m['ratio']['anthropic_floor']:.2f}x)",
                         "<= 1.2x floor", _verdict(ok, f"{ratio:.2f}x floor")))
            if not ok:
                fails.append(f"openai {api} replay {label} @{n}: deja "
                             f"{_fmt_ms(m[key]['per_call_ms'])} per call = "
                             f"{ratio:.2f}x floor")
    notes = [
        f"openai: the replay rows' agent workload in Chat Completions with the openai SDK "
        f"{r['openai_version']} ({r['model']}) against the stub: {n // r['conv_turns']} "
        f"conversations of {r['conv_turns']} calls, tool_calls alternating, each result a "
        "role: tool message, every request the whole conversation; JSON = "
        "chat.completions.create, streamed = create(stream=True) with every chunk iterated and "
        "text and tool-call arguments assembled. Responses: the same agent in the Responses "
        "API, each reply sent back as input items (the text, its function_call), each result "
        "a function_call_output item, every request all the items so far; JSON = "
        "responses.create, streamed = create(stream=True) with every event iterated, text "
        "deltas and finished function calls assembled. deja = replayer.replay of the openai "
        "SDK's recording (one per API); floor = the same client with "
        "http_client=httpx2.Client(transport=httpx2.MockTransport(...)) answering the "
        "recorded bytes in order from memory. The "
        "Anthropic deja and floor are the anthropic workload of the same shape, replayed in "
        f"the same rotated rounds; median of {r['json']['openai']['repeats']} replays each, "
        "after a warm-up; per call = (time of N calls)/N, client construction and load "
        "excluded."]
    return rows, notes, fails


def rows_overhead(r: dict[str, Any]) -> tuple[list[Row], list[str], list[str]]:
    o, m = r["overhead_ms"], r["median_per_call_ms"]
    ok = o["deja"] <= 0.3
    rw = (f"; agent-rewind {o['rewind']:+.3f} ms ({_fmt_ms(m['rewind'])})" if "rewind" in o
          else "; agent-rewind: not installed")
    rows: list[Row] = [(
        f"Recording overhead per call (N={r['n']})",
        f"{o['deja']:+.3f} ms ({_fmt_ms(m['deja'])} vs live {_fmt_ms(m['live'])})",
        f"vcrpy {o['vcr']:+.3f} ms ({_fmt_ms(m['vcr'])}){rw}",
        "<= 0.3 ms", _verdict(ok, f"{o['deja']:+.3f} ms")),
        ("  same, deja at fsync='exit'",
         f"{o['deja_exit']:+.3f} ms", f"bare append+fsync {r['raw_fsync_ms']:.3f} ms", "-",
         "info")]
    oc = r["open_close_ms"]
    notes = [f"overhead: {r['method']}, {r['rounds']} rounds x {r['n']} calls per variant, "
             f"order rotated; the replay's agent workload (conversations of "
             f"{r['conv_turns']} calls, growing history, alternating tools), not streamed, "
             "to a stub in a process of its own. "
             "deja at default fsync='turn' (model lines forced to disk by the "
             "background group commit, at most every 10 ms). Session open+close: deja "
             f"{_fmt_ms(oc['deja'])}, vcrpy {_fmt_ms(oc['vcr'])} (YAML save)"
             + (f", agent-rewind {_fmt_ms(oc['rewind'])}" if "rewind" in oc else "")
             + ". vcrpy records with its defaults (record_mode='all', default matchers); "
             "agent-rewind with rewind.patch_anthropic() + rewind.record(path), its defaults "
             "(a flushed JSON line per call holding the whole request, no fsync)."]
    fails = [] if ok else [f"recording overhead {o['deja']:.3f} ms per call > 0.3 ms"]
    return rows, notes, fails


def rows_ttft(r: dict[str, Any]) -> tuple[list[Row], list[str], list[str]]:
    t, tot = r["ttft_median_ms"], r["stream_total_median_ms"]
    ok = r["deja_minus_live_ms"] <= 0.3
    rows: list[Row] = [(
        "Time to first SSE delta (streamed)",
        f"{_fmt_ms(t['deja'])} (live {_fmt_ms(t['live'])}, {r['deja_minus_live_ms']:+.2f})",
        f"vcrpy {_fmt_ms(t['vcr'])} ({r['vcr_minus_live_ms']:+.1f})",
        "<= live + 0.3 ms", _verdict(ok, f"{r['deja_minus_live_ms']:+.2f} ms"))]
    notes = [f"ttft: request start -> first content_block_delta from messages.create("
             f"stream=True); 10 SSE events {r['event_delay_ms']} ms apart from a stub in a "
             "process of its own "
             f"({r['events_per_stream']} reach the iterator, the SDK drops ping), first delta "
             "is the 4th; "
             f"median of {r['calls']['deja']} calls per variant; whole stream: live "
             f"{_fmt_ms(tot['live'])}, deja {_fmt_ms(tot['deja'])}, vcrpy {_fmt_ms(tot['vcr'])}."]
    fails = [] if ok else [f"ttft: deja adds {r['deja_minus_live_ms']:.2f} ms (> 0.3 ms)"]
    return rows, notes, fails


def rows_size(r: dict[str, Any]) -> tuple[list[Row], list[str], list[str]]:
    rows: list[Row] = []
    fails: list[str] = []
    for one in r["runs"]:
        ratio, b, turns = one["ratio"], one["cassette_bytes"], one["turns"]
        kind = f"~{one['message_chars']}-char" if one["message_chars"] else "short"
        kind += " tool results" if not one.get("sdk_answers") else \
            " tool results, answers resent as the SDK returned them (random ids, nonces)"
        ok = ratio["deja"] <= 1.3
        anchors = [f"agent-rewind {ratio['rewind']:.1f}x ({_kb(b['rewind'])})" if "rewind" in b
                   else "agent-rewind: not installed",
                   f"vcrpy {ratio['vcr']:.1f}x ({_kb(b['vcr'])})" if "vcr" in b
                   else f"vcrpy: skipped (> {r['vcr_max_turns']} turns)"]
        rows.append((f"Cassette bytes / unique content, {turns} turns, {kind}",
                     f"{ratio['deja']:.2f}x ({_kb(b['deja'])})", "; ".join(anchors),
                     "<= 1.3x", _verdict(ok, f"{ratio['deja']:.2f}x")))
        if not ok:
            extra = (b["deja"] - one["unique"]["total"]) / turns
            fails.append(f"size, {turns} turns, {kind}: deja cassette is {ratio['deja']:.2f}x "
                         f"its unique content (> 1.3x); ~{extra:,.0f} B/turn beyond U against "
                         f"{one['unique']['total'] / turns:,.0f} B/turn of content")
    responses = r.get("responses") or []
    for one in responses:
        ratio, b, turns = one["ratio"], one["cassette_bytes"], one["turns"]
        ok = ratio <= 1.3
        rows.append((f"Cassette bytes / unique content, {turns} turns, OpenAI Responses",
                     f"{ratio:.2f}x ({_kb(b)}, {one['bytes_per_turn']:,.0f} B/turn)", "-",
                     "<= 1.3x", _verdict(ok, f"{ratio:.2f}x")))
        if not ok:
            fails.append(f"size, {turns} turns, Responses: deja cassette is {ratio:.2f}x its "
                         f"unique content (> 1.3x); {one['bytes_per_turn']:,.0f} B/turn")
    late = r.get("late_overhead")
    if late:
        rows.append((
            f"Recording overhead per call, turns {late['turns']} of {late['of_turns']}",
            f"{late['overhead_ms']:+.3f} ms (turns 1-{late['of_turns'] // 4}: "
            f"{late['first_turns_overhead_ms']:+.3f})",
            f"live {_fmt_ms(late['median_ms']['live'])}", "-", "info"))
    first = r["runs"][0]
    u = first["unique"]
    per_turn = ", ".join(
        f"{one['turns']}{'L' if one['message_chars'] else 'S'}"
        f"{'+sdk' if one.get('sdk_answers') else ''}: "
        f"{(one['cassette_bytes']['deja'] - one['unique']['total']) / one['turns']:,.0f} B "
        f"(halves {one['growth']['first_half_per_turn']:,.0f}/"
        f"{one['growth']['second_half_per_turn']:,.0f} B/turn)" for one in r["runs"])
    notes = [
        "size: one agent conversation of T turns (whole history in every request, search and "
        f"read_file alternating, tool results ~100 chars or ~{r['large_chars']} chars; and "
        "short, with every answer sent back as the SDK returned it, random tool-use ids and "
        "a nonce in every tool result), "
        "recorded by deja (defaults), agent-rewind (rewind.patch_anthropic() + rewind.record, "
        "defaults) and vcrpy (record_mode='all'"
        f"; skipped beyond {r['vcr_max_turns']} turns, where its YAML of every whole request "
        "takes minutes). Unique content U = sum len(canonical JSON) of each distinct message + "
        "each distinct request without messages (model, max_tokens, tools) + every response "
        "body as received, taken from one live run through an in-process capture transport; "
        "canonical JSON = sorted keys, ',' ':' separators, UTF-8. E.g. "
        f"{first['turns']} turns, short: {u['distinct_messages']} messages, U = "
        f"{_kb(u['total'])}, full requests would be {_kb(first['full_requests_bytes'])}.",
        f"size: deja bytes per turn beyond U (per-line metadata: response headers, signature, "
        f"timing, cost, request delta references), and per-turn bytes of the first/second "
        f"half of the cassette: {per_turn}."]
    if responses:
        notes.append(
            "size, OpenAI Responses: the same agent through the openai SDK "
            "(responses.create, every input item so far in each request), recorded by deja; "
            "U counts each distinct input item. Bytes per turn (first/second half): "
            + ", ".join(f"{one['turns']}: {one['bytes_per_turn']:,.0f} B "
                        f"({one['growth']['first_half_per_turn']:,.0f}/"
                        f"{one['growth']['second_half_per_turn']:,.0f})" for one in responses)
            + "; the same at every length is linear growth.")
    return rows, notes, fails


PAINT_TARGET_S = 1.5  # first paint of a run of up to 10,000 steps
HUGE_PAINT_TARGET_S = 3.0  # and of a longer one (the 100,000-step row)


def _paint_target(p: dict[str, Any]) -> float:
    return PAINT_TARGET_S if p["steps"] <= 10_000 else HUGE_PAINT_TARGET_S


def _paint_note(p: dict[str, Any]) -> str:
    made = ("written line by line with the cassette writer, signed, as recording that many "
            "through the SDK would take minutes," if p.get("written") else
            "through the SDK against the stub, recorded")
    return (
        f"viewer paint: `deja view` on 127.0.0.1, headless Chromium (Playwright, Debian's "
        f"chromium, 1280x800) opens ?run=<id> of a {p['steps']:,}-step run ({p['steps'] // 2:,} "
        f"model calls + {p['steps'] // 2:,} tool calls, {_kb(p['run_bytes'])}, {made} in "
        f"{p['record_s']:.1f} s, indexed in "
        f"{p['index_s']:.2f} s beforehand); time by the page's clock from the navigation's "
        f"start to the first frame where the timeline's canvas has text in its first row; "
        f"median of {p['loads']} loads, each in a new browser context (empty cache, new "
        f"session): {', '.join(f'{x:.2f}' for x in p['paint_s'])} s; the first, untimed "
        f"load {p['first_load_s']:.2f} s (the server's first session, which also fills "
        f"the viewer's cache of the timeline). The grid's accessible table holds all "
        f"{p['steps'] + 1:,} rows later ({', '.join(f'{x:.2f}' for x in p['grid_s'])} s)"
        + (f"; the Streamlit server's RSS {p['idle_rss_mib']:.0f} MiB before the loads, "
           f"{p['rss_mib']:.0f} MiB after, peak {p['peak_rss_mib']:.0f} MiB"
           if "rss_mib" in p else "") + ".")


def rows_viewer(r: dict[str, Any]) -> tuple[list[Row], list[str], list[str]]:
    f = r["filter"]
    paints = [x for x in (r.get("paint_small"), r["paint"], r.get("paint_huge")) if x]
    filter_ok = f["filter_ms"] < 1000.0
    rows: list[Row] = [
        (f"Viewer first paint, {p['steps']:,}-step run",
         f"{p['median_s']:.2f} s (all rows in the grid {p['grid_median_s']:.2f} s"
         + (f"; server RSS {p['rss_mib']:.0f} MiB, peak {p['peak_rss_mib']:.0f}"
            if "rss_mib" in p else "") + ")",
         "-", f"<= {_paint_target(p):g} s",
         _verdict(p["median_s"] <= _paint_target(p), f"{p['median_s']:.2f} s"))
        for p in paints]
    rows.append(
        (f"Runs-table filter, {f['runs']:,} runs (status + text)",
         f"{f['filter_ms']:.1f} ms ({f['filter_hits']} runs)",
         f"index build: {f['index_s']:.1f} s", "< 1 s", _verdict(filter_ok)))
    notes = [_paint_note(p) for p in paints]
    notes.append(
        f"viewer filter: {f['runs']:,} signed cassettes (model + tool step, end line; "
        f"written with CassetteWriter in {f['write_s']:.1f} s by {f.get('writers', 1)} "
        f"process(es){' into a tmpfs folder' if f.get('in_memory') else ''}) indexed, every "
        f"signature checked, in {f['index_s']:.1f} s (an unchanged refresh: "
        f"{f['refresh_unchanged_s'] * 1000:.0f} ms); viewer.queries.list_runs(status="
        f"completed, text=<word in 1% of the runs, other case>) median of {f['repeats']}; "
        f"no filter (first 500 rows) {f['all_ms']:.1f} ms; tool + model + min tokens + "
        f"since {f['combined_ms']:.1f} ms ({f['combined_rows']} runs).")
    fails = [f"viewer first paint of a {p['steps']:,}-step run {p['median_s']:.2f} s "
             f"(> {_paint_target(p):g} s)" for p in paints if p["median_s"] > _paint_target(p)]
    if not filter_ok:
        fails.append(f"runs-table filter over {f['runs']:,} runs {f['filter_ms']:.0f} ms "
                     "(>= 1 s)")
    return rows, notes, fails


def rows_resume(r: dict[str, Any]) -> tuple[list[Row], list[str], list[str]]:
    ok = r["median_s"] < 1.0
    rows: list[Row] = [(f"Resume fast-forward, {r['steps']:,}-step cassette",
                        f"{r['median_s']:.3f} s", "-", "< 1 s", _verdict(ok))]
    notes = [f"resume: a crashed run of {r['steps']:,} steps ({r['steps'] // 2:,} model calls "
             f"+ as many tool calls, {_kb(r['bytes'])}, no end line) resumed with "
             f"replayer.resume and the same agent, the stub server stopped; time from entering "
             f"resume (load, signature check, reopen) until the recorded prefix is used up "
             f"and the run goes live; median of {r['repeats']}: "
             f"{', '.join(f'{x:.3f}' for x in r['times_s'])} s."]
    fails = [] if ok else [f"resume fast-forward {r['median_s']:.2f} s (>= 1 s)"]
    return rows, notes, fails


def rows_load(r: dict[str, Any]) -> tuple[list[Row], list[str], list[str]]:
    d, fl, lines = r["deja"], r["json_floor"], r["lines"]
    ok = d["median_ms"] <= 300.0
    anchors = [f"json.loads of every line {_fmt_ms(fl['median_ms'])} "
               f"(deja {d['median_ms'] / fl['median_ms']:.0f}x that)"]
    rw = r.get("rewind")
    if rw:
        anchors.append(f"agent-rewind Trace.load {rw['load']['median_ms'] / 1000:.2f} s, "
                       f"Trace.open {rw['open']['median_ms'] / 1000:.2f} s ({_kb(rw['bytes'])})")
    else:
        anchors.append("agent-rewind: skipped" if r["rewind_skipped"]
                       else "agent-rewind: not installed")
    rows: list[Row] = [(
        f"Load + verify, {lines:,}-line cassette",
        f"{d['median_ms'] / 1000:.2f} s (min {d['min_ms'] / 1000:.2f} s; "
        f"{r['per_line_us']:.0f} µs/line; {_kb(r['bytes'])})",
        "; ".join(anchors), "<= 0.3 s", _verdict(ok, f"{d['median_ms'] / 1000:.2f} s"))]
    notes = [
        f"load: one agent run recorded through the SDK against the stub until the cassette "
        f"had {lines:,} lines: {r['model_calls']:,} model calls in conversations of "
        f"{r['conv_turns']} calls with growing history, each tool_use reply followed by the "
        f"@recorder.tool it names ({r['tool_calls']:,} tool lines, search/read_file "
        f"alternating), plus header and end line; {_kb(r['bytes'])}, recorded in "
        f"{r['record_ms'] / 1000:.0f} s. "
        f"recorder.cassette.load(path) (read, verify the HMAC chain over each line's bytes, "
        f"parse each line once, work out every model line's fingerprint; a line's other "
        f"compact fields are restored when it is read; verified=True checked), median of "
        f"{r['repeats']} after one untimed load: "
        f"{', '.join(f'{x:.0f}' for x in d['samples_ms'])} ms. Anchors on the same run: "
        f"read + json.loads of every line of the same file (the floor of any JSON-lines "
        f"reader), median of {r['repeats']}; the loads' order rotated round by round"
        + (f"; agent-rewind {r['rewind_version']} recording the same pass "
           f"(rewind.patch_anthropic() + rewind.record, @rewind.tool under @recorder.tool; "
           f"{rw['events']:,} events holding every whole request, {_kb(rw['bytes'])}): "
           f"rewind.trace.Trace.load (eager, every event parsed) and Trace.open (lazy: an "
           f"index of events, bodies parsed on access, what its replay uses), median of "
           f"{rw['repeats']}; neither verifies anything" if rw else "")
        + "; vcrpy not measured (its YAML of every whole request takes minutes to load)."]
    fails = [] if ok else [f"load + verify of a {lines:,}-line cassette "
                           f"{d['median_ms'] / 1000:.2f} s (> 0.3 s)"]
    return rows, notes, fails


def rows_memory(r: dict[str, Any]) -> tuple[list[Row], list[str], list[str]]:
    rss, traced, size = r["rss"], r["traced"], r["bytes"]
    used = r["rss_over_baseline_bytes"]
    ok = r["ratio_rss"] <= 3.0
    rows: list[Row] = [(
        f"Replay memory, {r['calls']:,}-call run (JSON)",
        f"peak RSS +{_kb(used)} = {r['ratio_rss']:.1f}x file (loaded: "
        f"+{_kb(r['rss_loaded_over_baseline_bytes'])}); tracemalloc peak "
        f"{_kb(traced['traced_peak_bytes'])} = {r['ratio_traced']:.1f}x file (loaded: "
        f"{_kb(traced['traced_loaded_bytes'])})",
        f"file {_kb(size)}; interpreter (baseline RSS) {_kb(rss['baseline_bytes'])}",
        "peak - interpreter <= 3x file", _verdict(ok, f"{r['ratio_rss']:.1f}x"))]
    notes = [
        f"memory: the replay rows' JSON workload ({r['calls']:,} calls, conversations of "
        f"{r['conv_turns']}) recorded, then replayed with replayer.replay in a fresh "
        "interpreter (nothing else of this run in it), the stub stopped. Baseline = peak RSS "
        "after importing everything, making the client and replaying a run of "
        f"{r.get('warm_calls', 20)} calls (what a replay imports on its first use, about "
        "15 MiB whatever the cassette, counts as the interpreter); deja = peak RSS after the "
        "replay "
        f"({_kb(rss['peak_bytes'])}) minus it. Peak RSS = {rss['source']} (the child's own "
        "high-water mark; getrusage ru_maxrss, which after fork + exec also counts the "
        f"parent's peak, read {_kb(rss['ru_maxrss_baseline_bytes'])} -> "
        f"{_kb(rss['ru_maxrss_peak_bytes'])}). A second fresh "
        "interpreter, run beside it, replays under tracemalloc started after the baseline: "
        "its peak counts Python allocations only (not allocator slack). Loaded = the same "
        "peaks once replayer.replay has loaded the cassette, before the first call. One child "
        "each; replay took "
        f"{rss['replay_s']:.1f} s (traced {traced['replay_s']:.1f} s)."]
    fails = [] if ok else [f"replay memory of a {r['calls']:,}-call run: peak RSS "
                           f"+{_kb(used)} over the interpreter = {r['ratio_rss']:.1f}x the "
                           f"cassette's {_kb(size)} (> 3x); "
                           f"+{_kb(r['rss_loaded_over_baseline_bytes'])} of it already once the "
                           "cassette is loaded"]
    return rows, notes, fails


def _mib(x: float | None) -> str:
    return f"{x:.1f}" if x is not None else "?"


def _cpu(m: dict[str, Any]) -> str:
    c, f = m.get("proxy_cpu_ms_per_call"), m.get("forwarder_cpu_ms_per_call")
    if c is None:
        return ""
    return f"; CPU per call: proxy {c:.2f} ms" + (f", forwarder {f:.2f} ms" if f else "")


def _fwd(m: dict[str, Any], key: str = "added_ms") -> str:
    """The bare forwarder's added time (``key``) in ``m``, signed."""
    return f"{m['forwarder_vs_direct'][key]:+.3f} ms"


def rows_proxy_one(r: dict[str, Any]) -> tuple[list[Row], list[str]]:
    """The proxy at one client: a JSON call's added p50/p99, a stream's first event, a paced
    stream's first event and inter-frame gaps; each beside the bare forwarder."""
    rows: list[Row] = []
    fails: list[str] = []
    j, s = r["json"]["1"], r["sse"]["1"]
    ok = j["added_ms"] <= 0.5
    fc = j["first_call"]
    rows.append((
        f"Proxy added latency, JSON, 1 client (N={j['proxied']['n']})",
        f"p50 {j['added_ms']:+.3f} ms, p99 {j['added_p99_ms']:+.3f} ms "
        f"({_fmt_ms(j['proxied']['median_ms'])} vs direct {_fmt_ms(j['direct']['median_ms'])})",
        f"bare forwarder p50 {_fwd(j)}, p99 {_fwd(j, 'added_p99_ms')}; direct p99 "
        f"{_fmt_ms(j['direct']['p99_ms'])}; first call of a run "
        f"{fc['proxied']['median_ms'] - fc['direct']['median_ms']:+.2f} ms{_cpu(j)}",
        "<= +0.5 ms p50, p99 published", _verdict(ok, f"{j['added_ms']:+.3f} ms")))
    if not ok:
        fails.append(f"proxy adds {j['added_ms']:.3f} ms per JSON call at p50 (> 0.5 ms; the "
                     f"bare forwarder adds {j['forwarder_vs_direct']['added_ms']:.3f} ms)")
    ok = s["added_ms"] <= 1.0
    st = s["stream_total"]
    rows.append((
        f"Proxy time to first SSE event, 1 client (N={s['proxied']['n']})",
        f"{s['added_ms']:+.3f} ms ({_fmt_ms(s['proxied']['median_ms'])} vs direct "
        f"{_fmt_ms(s['direct']['median_ms'])})",
        f"bare forwarder {_fwd(s)}; whole stream {st['added_ms']:+.2f} ms (forwarder "
        f"{_fwd(st)}){_cpu(s)}", "<= +1 ms", _verdict(ok, f"{s['added_ms']:+.3f} ms")))
    if not ok:
        fails.append(f"proxy adds {s['added_ms']:.3f} ms to the first SSE event (> 1 ms)")
    pc = r.get("paced")
    if pc:
        t, g = pc["ttft"], pc["gaps"]
        ok = t["added_ms"] <= 1.0 and g["added_p99_ms"] <= 1.0
        rows.append((
            f"Proxy on a paced stream ({pc['pace_ms']} ms between events, "
            f"N={t['proxied']['n']} streams)",
            f"first event {t['added_ms']:+.3f} ms; inter-frame p50 {g['added_ms']:+.3f} ms, "
            f"p99 {g['added_p99_ms']:+.3f} ms",
            f"bare forwarder: first event {_fwd(t)}, inter-frame p50 {_fwd(g)}, p99 "
            f"{_fwd(g, 'added_p99_ms')}; direct inter-frame p50 "
            f"{_fmt_ms(g['direct']['median_ms'])}, p99 {_fmt_ms(g['direct']['p99_ms'])}",
            "<= +1 ms first event, <= +1 ms inter-frame p99",
            _verdict(ok, f"{t['added_ms']:+.2f} / {g['added_p99_ms']:+.2f} ms")))
        if not ok:
            fails.append(f"proxy on a paced stream: first event {t['added_ms']:+.2f} ms, "
                         f"inter-frame p99 {g['added_p99_ms']:+.2f} ms (> 1 ms)")
    return rows, fails


def rows_proxy_load(r: dict[str, Any]) -> tuple[list[Row], list[str]]:
    """The proxy under load: 32 and 200 clients against direct's throughput and p95, the
    throughput frontier, and its memory; each beside the bare forwarder."""
    rows: list[Row] = []
    fails: list[str] = []
    for kind, label in (("json", "JSON per call"), ("sse", "first SSE event")):
        for n, m in r[kind].items():
            if n == "1":
                continue
            d, p, f = m["direct"], m["proxied"], m["forwarder"]
            share = p.get("calls_per_s", 0) / d["calls_per_s"] if d.get("calls_per_s") else 0
            tail = p.get("p95_ms", 0) / d["p95_ms"] if d.get("p95_ms") else float("inf")
            ok = p["errors"] == 0 and share >= 0.9 and tail <= 2.0
            rows.append((
                f"Proxy, {label}, {n} concurrent clients (N={p['n']})",
                f"{p.get('calls_per_s', 0):.0f} calls/s ({share:.0%} of direct); median "
                f"{_fmt_ms(p.get('median_ms', 0))}, p95 {_fmt_ms(p.get('p95_ms', 0))} "
                f"({tail:.1f}x direct); {p['errors']} errors",
                f"direct {d.get('calls_per_s', 0):.0f} calls/s, median "
                f"{_fmt_ms(d.get('median_ms', 0))}, p95 {_fmt_ms(d.get('p95_ms', 0))}; bare "
                f"forwarder {f.get('calls_per_s', 0):.0f} calls/s, p95 "
                f"{_fmt_ms(f.get('p95_ms', 0))}{_cpu(m)}",
                ">= 90% of direct calls/s, p95 <= 2x direct, 0 errors",
                _verdict(ok, f"{share:.0%}, {tail:.1f}x, {p['errors']} errors")))
            if not ok:
                fails.append(f"proxy, {kind} at {n} clients: {share:.0%} of direct's calls/s, "
                             f"p95 {tail:.1f}x direct's, {p['errors']} errors")
    fr = r.get("frontier")
    if fr:
        fits = {b: fr[f"p99_{b}ms"] for b in fr["bounds_ms"]}

        def cell(kind: str) -> str:
            return " / ".join(f"{fits[b][kind]['calls_per_s']:.0f}" for b in fits)

        share = [fits[b]["proxied"]["calls_per_s"] / fits[b]["direct"]["calls_per_s"]
                 if fits[b]["direct"]["calls_per_s"] else 0.0 for b in fits]
        ok = all(x >= 0.9 for x in share)
        bounds = " / ".join(str(b) for b in fits)
        rows.append((
            f"Proxy throughput frontier, JSON: calls/s with p99 <= {bounds} ms",
            f"{cell('proxied')} calls/s",
            f"direct {cell('direct')}; bare forwarder {cell('forwarder')} (clients "
            f"{', '.join(fr['levels'])})", ">= 90% of direct at each bound",
            _verdict(ok, " / ".join(f"{x:.0%}" for x in share))))
        if not ok:
            fails.append(f"proxy throughput frontier (p99 <= {bounds} ms): "
                         f"{cell('proxied')} calls/s against direct's {cell('direct')}")
        rss = fr["rss_mib"]
        rows.append((
            "Proxy memory (RSS) idle / steady / after load",
            " / ".join(_mib(rss[k]["proxied"]) for k in ("idle", "steady", "after_load"))
            + " MiB",
            "bare forwarder " + " / ".join(_mib(rss[k]["forwarder"])
                                           for k in ("idle", "steady", "after_load")) + " MiB",
            "-", "info"))
    return rows, fails


def rows_proxy(r: dict[str, Any]) -> tuple[list[Row], list[str], list[str]]:
    one, fails = rows_proxy_one(r)
    load, more = rows_proxy_load(r)
    j = r["json"]["1"]
    fr = r.get("frontier", {})
    many = r["json"].get("32", {})
    notes = [
        f"proxy: `python -m deja proxy --port 0 --ready-file F --upstream STUB --dir TMP` "
        "(record mode, default guards, fsync='turn', a log line per request) and the bare "
        "forwarder (bench/proxy_forwarder.py: the same uvicorn + httptools + uvloop stack, "
        "header guard and pooled aiohttp client, forwarding bytes with no run, no cassette, "
        "no guard, no log), a fresh pair per section, in front of the stub (`deja stub`, a "
        "ThreadingHTTPServer, in a process of its own); direct = the same calls to the stub. "
        f"Conversations of {r['turns']} calls with growing history (a run and its cassette "
        "per conversation, every cassette checked to be there). JSON: anthropic SDK "
        "messages.create, tools alternating; SSE: the same conversations streamed, sent with "
        "httpx2, first event = request start -> first chunk with `event:` bytes (stub events "
        f"{r['event_delay_ms']} ms apart), each stream read to its end; paced: events "
        f"{r.get('paced', {}).get('pace_ms', '?')} ms apart, inter-frame = the gap between "
        "two reads holding events. 1 client: sync, blocks "
        f"of {j['calls_per_block']} calls, direct, forwarder and proxied alternating, rotated "
        f"each round, {j['rounds']} rounds after a warm-up block each. 32 and 200 clients: one "
        "asyncio loop (AsyncAnthropic / httpx2.AsyncClient, connection limit above the "
        f"clients), each client {many.get('conversations_per_client', '?')} "
        "conversations one call after another after one untimed call; "
        f"{many.get('rounds', '?')} rounds alternating. "
        "Frontier: the same at "
        f"{', '.join(fr.get('levels', {})) or '?'} clients, one proxy and forwarder for the "
        "sweep, per bound the most calls/s of a level whose p99 is within it. Memory: VmRSS "
        "of that proxy listening (idle), after the first level (steady), after the last. "
        "max_retries=0: every failure counts. Added = difference of medians (p99: of p99s); "
        "CPU per call = the process's user+system time over its blocks / calls (the proxy's "
        "includes work done after a response was sent). All four processes share this "
        f"machine's {os.cpu_count()} CPUs."]
    return one + load, notes, fails + more


def rows_runs(r: dict[str, Any]) -> tuple[list[Row], list[str], list[str]]:
    rows: list[Row] = []
    fails: list[str] = []
    for key, label in (("sqlite", "embedded SQLite"), ("postgres", "Postgres")):
        post, floor = r[key]["post"], r[key]["engine"]
        ok = post["median_ms"] <= 40.0
        rows.append((
            f"POST /runs to an id, {label} (N={post['n']})",
            f"median {_fmt_ms(post['median_ms'])} (p95 {_fmt_ms(post['p95_ms'])})",
            f"the engine's enqueue alone {_fmt_ms(floor['median_ms'])} (p95 "
            f"{_fmt_ms(floor['p95_ms'])}); {post['median_ms'] / floor['median_ms']:.1f}x",
            "<= 40 ms", _verdict(ok, f"{post['median_ms']:.1f} ms")))
        if not ok:
            fails.append(f"POST /runs, {label}: median {post['median_ms']:.1f} ms (> 40 ms)")
    cli = r["sqlite"].get("cli")
    if cli:
        ok = cli["submit"]["median_ms"] <= 500.0
        rows.append((
            f"deja submit, a fresh process, to an id (N={cli['submit']['n']})",
            f"median {_fmt_ms(cli['submit']['median_ms'])}",
            f"python -c pass {_fmt_ms(cli['python']['median_ms'])}",
            "<= 500 ms", _verdict(ok, f"{cli['submit']['median_ms']:.0f} ms")))
        if not ok:
            fails.append(f"deja submit: median {cli['submit']['median_ms']:.0f} ms (> 500 ms)")
    notes = [
        "runs: `python -m deja serve --port 0` in its own process, no worker (the submission "
        f"alone); {r['n']} POST /runs over one kept-alive connection after 5 untimed, request "
        "start -> parsed {run_id, status}; engine floor = deja.runs.engine.Client.submit "
        "(DBOSClient.enqueue) of the same submission in a process of its own, on the same "
        "database; Postgres = a throwaway local server (tests/pg_server.py, fsync off). "
        "deja submit = a fresh `python -m deja submit -- python agent.py` to the same server."]
    return rows, notes, fails


def rows_suite(r: dict[str, Any]) -> tuple[list[Row], list[str], list[str]]:
    """deja suite over n unchanged incidents: inline and on a worker, against a minute per
    hundred incidents."""
    n, cpus = r["n"], r["cpus"]
    limit = 60.0 * n / 100
    rows: list[Row] = []
    fails: list[str] = []
    for key, label in (("inline", f"inline, -j {cpus}"), ("workers", "on 1 deja worker"),
                       ("cold", f"inline, -j {cpus}, --cold")):
        if key not in r:
            continue
        m = r[key]
        ok = m["seconds"] < limit or key == "cold"
        rows.append((f"Incident suite, {n} unchanged incidents, {label}",
                     f"{m['seconds']:.1f} s ({m['seconds'] / n:.2f} s per incident; one "
                     f"incident {m['incident_median_s']:.2f} s in the suite)",
                     f"one deja replay {r['replay_s']:.2f} s, x {n} / {cpus} CPUs = "
                     f"{r['replay_s'] * n / cpus:.1f} s; python -c pass {r['python_s']:.3f} s",
                     "-" if key == "cold" else f"< {limit:.0f} s",
                     "info" if key == "cold" else _verdict(ok, f"{m['seconds']:.1f} s")))
        if not ok:
            fails.append(f"suite {label}: {n} incidents in {m['seconds']:.1f} s (> {limit:.0f} s)")
    notes = [
        f"suite: {n} incidents, copies of {r['distinct']} recordings (examples/streaming_agent.py "
        "and examples/retry_spiral.py, recorded against the stub), replayed by their recorded "
        "commands, all identical; `python -m deja suite incidents --json` timed from start to "
        "exit, inline (one job per CPU) and with one `deja worker` up on the embedded SQLite "
        "database (each incident a workflow on the suite's queue). Each incident is a job "
        "that replays the program as a child under deja's bootstrap; both start warm, as "
        "forks of one fork server that imported deja and the SDKs once (the worker keeps "
        "its own). The --cold row starts a fresh interpreter for each, as one `deja replay` "
        "of one incident does (the anchor)."]
    return rows, notes, fails


MEASURES = {
    "replay": (replay_speed.run, rows_replay),
    "openai": (openai_replay.run, rows_openai),
    "overhead": (record_overhead.run, rows_overhead),
    "ttft": (ttft.run, rows_ttft),
    "size": (cassette_size.run, rows_size),
    "resume": (resume_speed.run, rows_resume),
    "load": (load_speed.run_load, rows_load),
    "memory": (load_speed.run_memory, rows_memory),
    "viewer": (viewer_speed.run, rows_viewer),
    "proxy": (proxy_speed.run, rows_proxy),
    "runs": (runs_submit.run, rows_runs),
    "suite": (suite_speed.run, rows_suite),
}


def params(quick: bool, full_vcr: bool) -> dict[str, dict[str, Any]]:
    if quick:
        return {"replay": {"small": 40, "large": 400, "repeats": 3, "vcr_repeats": 1,
                           "stride": 10, "full_vcr": full_vcr},
                "openai": {"n": 40, "repeats": 3},
                "overhead": {"n": 100, "n_rounds": 2},
                "ttft": {"calls_per_block": 5, "n_rounds": 1},
                "size": {"turns": (20, 50), "large_chars": 1000, "vcr_max_turns": 50,
                         "late_turns": 50},
                "resume": {"steps": 1000, "repeats": 3},
                "load": {"lines": 2000, "repeats": 3, "rewind_repeats": 1},
                "memory": {"calls": 400},
                "viewer": {"steps": 2000, "huge_steps": 20_000, "loads": 3, "runs": 2000,
                           "repeats": 5},
                "proxy": {"calls": 100, "block": 25, "convs_per_client": 1, "conc_rounds": 1,
                          "frontier_levels": (1, 8), "frontier_calls": 100,
                          "paced_streams": 20},
                "runs": {"n": 20, "cli_n": 3},
                "suite": {"n": 20, "repeats": 1}}
    return {"replay": {"small": 200, "large": 2000, "repeats": 5, "vcr_repeats": 1,
                       "stride": 100, "full_vcr": full_vcr},
            "openai": {"n": 200, "repeats": 5},
            "overhead": {"n": 300, "n_rounds": 5},
            "ttft": {"calls_per_block": 20, "n_rounds": 5},
            "size": {"turns": (50, 200, 800), "large_chars": 1000, "vcr_max_turns": 200,
                     "late_turns": 200},
            "resume": {"steps": 1000, "repeats": 5},
            "load": {"lines": 10_000, "repeats": 5, "rewind_repeats": 3},
            "memory": {"calls": 2000},
            "viewer": {"steps": 10_000, "small_steps": 2000, "huge_steps": 100_000, "loads": 5,
                       "runs": 100_000, "repeats": 7},
            "proxy": {"calls": 300, "block": 50, "convs_per_client": 2, "conc_rounds": 2},
            "runs": {"n": 50, "cli_n": 10},
            "suite": {"n": 100, "repeats": 3}}


# ---------------------------------------------------------------------------- output


def print_table(rows: list[Row], notes: list[str], fails: list[str], title: str) -> None:
    headers = ("metric", "deja", "anchor", "target", "result")
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        Console = None
    if Console is not None:
        console = Console(width=max(shutil.get_terminal_size((160, 20)).columns, 160))
        table = Table(title=title, show_lines=False)
        for h in headers:
            table.add_column(h, overflow="fold")
        for row in rows:
            style = "red" if row[4].startswith("FAIL") else (
                "green" if row[4].startswith("PASS") else None)
            table.add_row(*row[:4], f"[{style}]{row[4]}[/{style}]" if style else row[4])
        console.print(table)
        for note in notes:
            console.print(f"  - {note}", highlight=False, soft_wrap=True)
        for fail in fails:
            console.print(f"  [bold red]FAIL[/bold red] {fail}", highlight=False,
                          soft_wrap=True)
        return
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = " | ".join(h.ljust(widths[i]) for i, h in enumerate(headers))
    print(title)
    print(line)
    print("-+-".join("-" * wd for wd in widths))
    for row in rows:
        print(" | ".join(c.ljust(widths[i]) for i, c in enumerate(row)))
    for note in notes:
        print(f"  - {note}")
    for fail in fails:
        print(f"  FAIL {fail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small N, for a smoke run")
    parser.add_argument("--only", action="append", metavar="NAME",
                        help=f"run only these ({', '.join(NAMES)}); repeatable or comma list")
    parser.add_argument("--full-vcr", action="store_true",
                        help="replay all calls of vcrpy's large cassette (several minutes)")
    args = parser.parse_args(argv)
    only = [n.strip() for item in (args.only or []) for n in item.split(",") if n.strip()]
    unknown = sorted(set(only) - set(NAMES))
    if unknown:
        parser.error(f"unknown measurement(s) {', '.join(unknown)}; choose from "
                     f"{', '.join(NAMES)}")
    selected = [n for n in NAMES if not only or n in only]
    cfg = params(args.quick, args.full_vcr)

    rows: list[Row] = []
    notes: list[str] = []
    fails: list[str] = []
    results: dict[str, Any] = {}
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    for name in selected:
        run, to_rows = MEASURES[name]
        t0 = time.perf_counter()
        print(f"[bench] {name} ...", file=sys.stderr, flush=True)
        try:
            res = run(**cfg[name])
        except Exception as exc:  # noqa: BLE001 - one broken measurement must not hide others
            traceback.print_exc()
            rows.append((name, "ERROR", "-", "-", f"FAIL ({type(exc).__name__})"))
            fails.append(f"{name}: the measurement crashed: {exc}")
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        res["seconds"] = round(time.perf_counter() - t0, 2)
        print(f"[bench] {name} done in {res['seconds']:.1f}s", file=sys.stderr, flush=True)
        results[name] = res
        r, n, f = to_rows(res)
        rows += r
        notes += n
        fails += f

    elapsed = time.perf_counter() - started
    load_after = os.getloadavg()[0]
    title = (f"deja benchmarks{' (--quick)' if args.quick else ''}: python "
             f"{platform.python_version()}, {platform.machine()}, {os.cpu_count()} CPUs, "
             f"load avg {load_before:.1f} -> {load_after:.1f}, {elapsed:.0f}s")
    print_table(rows, notes, fails, title)
    if not fails:
        print("all targets met")

    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    doc = {"created": datetime.now(UTC).isoformat(timespec="seconds"),
           "quick": args.quick, "selected": selected, "seconds": round(elapsed, 1),
           "python": platform.python_version(), "platform": platform.platform(),
           "cpus": os.cpu_count(), "loadavg_1min": [load_before, load_after],
           "rows": [dict(zip(("metric", "deja", "anchor", "target", "result"), r, strict=True))
                    for r in rows],
           "failures": fails, "results": results}
    RESULTS.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    print(f"results written to {RESULTS.relative_to(BENCH.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
