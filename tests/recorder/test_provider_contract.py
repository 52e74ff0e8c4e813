"""Adding a provider is one module: the contract, tested end to end with a plugin.

``toy_plugin/toy_deja.py`` is a made-up model API as one provider module, written against
``recorder.providers`` alone: its own endpoint, request shape (a growing ``turns`` list,
a ``nonce`` that means nothing), JSON answers and NDJSON streams, token names and tool
turns. It is installed as a package would be (the module and a ``dist-info`` with its
``deja.providers`` entry point, in a directory on the path; no change to deja) and goes
through every path: a recording (usage, cost, stop reason, requests stored as what they
add), a replay bit for bit with its server stopped and a divergence, a fork that edits a
streamed answer and goes live, ``deja diff``, ``deja proxy`` recording it (tool steps
included) and replaying it in a process of its own, ``deja export`` as OpenTelemetry
GenAI spans (model, usage, cost), and the viewer's reading of a step. The agent and the
toy API's server are in ``toy_plugin/toy_server.py``. Every test fails without the
plugin: the toy's calls would be plain HTTP.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from toy_plugin.toy_server import KEY, MODEL, QUESTION, RULES, ToyServer, toy_loop

import recorder
import replayer
from recorder import providers
from recorder.cassette import Cassette, load
from recorder.cassette.schema import Kind
from recorder.providers import registry
from replayer import diff
from viewer import content

sys.path.insert(0, str(Path(__file__).parents[1] / "proxy"))  # proxy_helpers
from proxy_helpers import ProxyProcess, cassettes, load_verified

PLUGIN = Path(__file__).parent / "toy_plugin" / "toy_deja.py"
URL_PATH = "/toy/v1/generate"
PRICES = {MODEL: {"input": 2.0, "output": 8.0, "cache_read": 0.5}}  # $ per million tokens

Proxy = Callable[..., ProxyProcess]


def usage(turns: int, results: int) -> dict[str, int]:
    """What the toy server counts for a request of ``turns`` turns, ``results`` of them
    tool results."""
    return {"input_tokens": 10 * turns, "output_tokens": 5 + results,
            "cache_read_input_tokens": 4}


def cost(counts: dict[str, int]) -> float:
    return round((counts["input_tokens"] * 2.0 + counts["output_tokens"] * 8.0
                  + counts["cache_read_input_tokens"] * 0.5) / 1_000_000, 8)


# The loop's three calls: 1 turn; then 4 (an answer of two turns and a result); then 7.
USAGES = [usage(1, 0), usage(4, 1), usage(7, 2)]


@pytest.fixture
def plugin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The toy provider, installed as pip installs a package: its module and its ``dist-info``
    (``METADATA``, ``entry_points.txt`` naming ``toy = toy_deja:provider`` in the
    ``deja.providers`` group) in a directory on the path, found by deja's own plugin
    loading. Yields the directory, for a subprocess's ``PYTHONPATH``."""
    site = tmp_path_factory.mktemp("site-packages")
    shutil.copy(PLUGIN, site / "toy_deja.py")
    info = site / "toy_deja-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-deja\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[deja.providers]\ntoy = toy_deja:provider\n")
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    try:
        assert registry.load_plugins() == ["toy"]
        yield site
    finally:
        providers.unregister("toy")
        sys.path.remove(str(site))
        sys.modules.pop("toy_deja", None)
        importlib.invalidate_caches()


@pytest.fixture
def toy() -> Iterator[ToyServer]:
    server = ToyServer()
    yield server
    server.stop()


def plugin_env(site: Path) -> dict[str, str]:
    """The environment of a deja process that has the plugin installed."""
    paths = [str(site), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {"PYTHONPATH": os.pathsep.join(paths)}


def deja(site: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``deja ARGS`` run to completion as a process of its own, with the plugin."""
    return subprocess.run([sys.executable, "-m", "deja", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120, env={**os.environ, **plugin_env(site)})


def record(server: ToyServer, path: Path, **loop: Any) -> list[bytes]:
    with recorder.record(path, prices=PRICES):
        return toy_loop(server.url, **loop)


def models(cassette: Cassette) -> list[Any]:
    return [o for o in cassette.observations if o["kind"] == Kind.MODEL]


def stored_lines(path: Path) -> list[dict[str, Any]]:
    """The model lines as they are on disk (requests stored as deltas)."""
    return [line for line in map(json.loads, path.read_bytes().splitlines()[1:])
            if line.get("kind") == Kind.MODEL]


def answer_id(raw: bytes) -> str:
    """The id of a toy answer as received, JSON or NDJSON."""
    return str(json.loads(raw.splitlines()[0])["id"])


# ------------------------------------------------------------- recorded and replayed


def test_a_plugin_provider_is_recorded_as_deltas_and_replayed_bit_for_bit(
        plugin: Path, toy: ToyServer, tmp_path: Path) -> None:
    path = tmp_path / "toy.jsonl"
    with recorder.record(path, prices=PRICES) as run:
        recorded = toy_loop(toy.url)
    assert len(recorded) == 3 and b"Found: deja: French" in recorded[2]
    assert run.totals["model_calls"] == 3 and run.totals["http_calls"] == 0

    cassette = load(path)
    lines = models(cassette)
    assert [o["provider"] for o in lines] == ["toy"] * 3
    assert [o["model"] for o in lines] == [MODEL] * 3
    assert [o["stream"] for o in lines] == [False, True, False]
    assert [o["stop_reason"] for o in lines] == ["call", "call", "done"]
    assert [o["usage"] for o in lines] == USAGES
    assert [o["cost_usd"] for o in lines] == [cost(u) for u in USAGES]
    assert [o["message_id"] for o in lines] == [answer_id(raw) for raw in recorded]
    assert ["ttft_ms" in o for o in lines] == [False, True, False]  # the toy's stream rule
    assert [o["name"] for o in cassette.observations if o["kind"] == Kind.TOOL] == \
        ["lookup", "lookup"]
    # the key is not kept, nor the header the carriage calls volatile
    assert KEY.encode() not in path.read_bytes()
    assert all("x-toy-trace" in h for h in toy.headers) and b"x-toy-trace" not in \
        path.read_bytes()

    # each request after the first is stored as the one before it and the turns it adds
    seam = providers.get("toy")
    stored = stored_lines(path)
    assert set(stored[0]["request"]) == {"body"}
    for n, line in enumerate(stored[1:], start=1):
        delta, before = line["request"], toy.requests[n - 1]["turns"]
        assert delta["base"] == stored[n - 1]["seq"] and delta["keep"] == len(before)
        assert delta["turns"] == toy.requests[n]["turns"][len(before):]
        assert [t["kind"] for t in delta["turns"]] == ["say", "call", "result"]
        assert set(delta) == {"base", "keep", "turns", "set"}  # set: the nonce, the stream
    for line, body in zip(lines, toy.requests, strict=True):
        assert cassette.request_of(line["seq"]) == body
        assert line["fp"] == seam.fingerprint("POST", line["url"], body)

    served = len(toy.requests)
    toy.stop()
    with replayer.replay(path) as replay:  # new nonces and traces; nothing listens
        assert toy_loop(toy.url) == recorded
    assert replay.result is not None and replay.result.identical, replay.result.report()
    assert len(toy.requests) == served

    with pytest.raises(recorder.Divergence) as info, replayer.replay(path):
        toy_loop(toy.url, question="Look up vu")
    assert info.value.step == 0
    assert "Look up vu" in info.value.diff and QUESTION in info.value.diff


def test_a_fork_serves_an_edited_toy_stream_then_goes_live(plugin: Path, toy: ToyServer,
                                                          tmp_path: Path) -> None:
    parent = tmp_path / "parent.jsonl"
    recorded = record(toy, parent)
    streamed = next(o for o in models(load(parent)) if o["stream"])
    served = len(toy.requests)

    out = tmp_path / "fork.jsonl"
    with replayer.fork(parent, at=streamed["seq"], out=out,
                       sets=["turns.1.args.word=forked"]) as run:
        forked = toy_loop(toy.url)
    assert run.live  # the prefix was used up; what came after went out
    assert forked[0] == recorded[0]
    events = [json.loads(line) for line in forked[1].splitlines()]  # NDJSON, synthesised
    assert [e["event"] for e in events] == ["begin", "text", "call", "finish"]
    assert events[2]["args"] == {"word": "forked"} and events[1]["piece"] == "Looking up again."
    assert events[3] == {"event": "finish", "finish": "call", "tokens": {"out": 6}}

    # the agent ran its tool on the edit, and the toy API saw it in the next request
    assert len(toy.requests) == served + 1
    sent = toy.requests[-1]["turns"]
    assert sent[5]["args"] == {"word": "forked"}
    assert sent[6]["output"] == "forked: French for 'already'"
    assert b"forked: French for 'already'" in forked[2]

    fork = load(out, keyring=recorder.load_keyring(), require_signature=True)
    [edited] = [o for o in fork.observations if o.get("edited")]
    assert edited["provider"] == "toy" and edited["stop_reason"] == "call"
    assert edited["usage"] == USAGES[1]
    tools = [o for o in fork.observations if o["kind"] == Kind.TOOL]
    assert [t["args"] for t in tools] == [{"word": "deja"}, {"word": "forked"}]
    assert fork.end is not None and fork.end["status"] == "completed"

    toy.stop()
    with replayer.replay(out) as again:  # the fork replays like any run
        assert toy_loop(toy.url) == forked
    assert again.result is not None and again.result.identical, again.result.report()


def test_two_toy_runs_diff_as_the_same_and_a_changed_turn_does_not(
        plugin: Path, toy: ToyServer, tmp_path: Path) -> None:
    a, b, c = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    first, second = record(toy, a), record(toy, b)
    assert answer_id(first[0]) != answer_id(second[0])  # new ids, call ids, nonces
    assert toy.requests[1]["turns"][2]["id"] != toy.requests[4]["turns"][2]["id"]
    assert diff.compare(load(a), load(b)).same

    record(toy, c, question="Look up vu")
    changed = diff.compare(load(a), load(c))
    assert not changed.same and changed.first_divergence == 0
    first_step = changed.steps[0]
    assert [(ch.path, ch.a, ch.b) for ch in first_step.changes
            if ch.path.startswith("/request")] == [
        ("/request/messages/0/content/0/text", QUESTION, "Look up vu")]
    assert any(ch.path == "/response/message/content/1/input/word" for s in changed.steps
               for ch in s.changes)
    assert "reply: tool call lookup" in {label for s in changed.steps
                                         for label in s.messages.values()}


# ------------------------------------------------------------------ deja proxy


def test_deja_proxy_records_and_replays_a_plugin_provider(plugin: Path, toy: ToyServer,
                                                        proxy: Proxy, tmp_path: Path) -> None:
    env = plugin_env(plugin)
    directory = tmp_path / "runs"
    recording = proxy("--upstream", toy.url, "--dir", str(directory), env=env)
    recorded = toy_loop(recording.url)
    status, log = recording.stop()
    assert status == 0, log
    assert [h["authorization"] for h in toy.headers] == [f"Bearer {KEY}"] * 3

    [path] = cassettes(directory)
    assert KEY.encode() not in path.read_bytes()
    cassette = load_verified(path)
    lines = models(cassette)
    assert [o["provider"] for o in lines] == ["toy"] * 3
    assert [o["url"] for o in lines] == [toy.url + URL_PATH] * 3
    assert [o["usage"] for o in lines] == USAGES
    assert [o["stop_reason"] for o in lines] == ["call", "call", "done"]
    assert [o["message_id"] for o in lines] == [answer_id(raw) for raw in recorded]
    assert [set(line["request"]) - {"set"} for line in stored_lines(path)] == [
        {"body"}, {"base", "keep", "turns"}, {"base", "keep", "turns"}]
    assert cassette.end is not None and cassette.end["status"] == "completed"
    # the agent's tools, seen in the conversation its requests carry
    tools = [o for o in cassette.observations if o["kind"] == Kind.TOOL]
    assert [(t["name"], t["args"], t["result"]) for t in tools] == [
        ("lookup", {"word": w}, f"{w}: French for 'already'") for w in ("deja", "again")]
    assert [t["call_id"] for t in tools] == [turn["id"] for turn in toy.requests[2]["turns"]
                                             if turn["kind"] == "result"]

    toy.stop()
    replaying = proxy("--replay", str(path), env=env)
    replayed = toy_loop(replaying.url)
    status, log = replaying.stop()
    assert status == 0, log
    assert ": identical" in log and "steps:      5/5 served" in log, log
    assert replayed == recorded


# ---------------------------------------------------------------- deja export


def _value(value: dict[str, Any]) -> Any:
    (kind, held), = value.items()
    if kind == "arrayValue":
        return [_value(v) for v in held.get("values", [])]
    return int(held) if kind == "intValue" else held


def exported_spans(site: Path, path: Path, *flags: str) -> list[tuple[str, dict[str, Any]]]:
    """(name, attributes) of each span ``deja export`` writes of the cassette at ``path``,
    run as a process of its own with the plugin installed."""
    out = path.with_suffix(".otlp.json")
    done = deja(site, "export", str(path), "--format", "otlp-json", "-o", str(out), *flags,
                cwd=path.parent)
    assert done.returncode == 0, done.stdout + done.stderr
    (resource,) = json.loads(out.read_text())["resourceSpans"]
    return [(s["name"], {kv["key"]: _value(kv["value"]) for kv in s.get("attributes", [])})
            for scope in resource["scopeSpans"] for s in scope["spans"]]


def test_deja_export_reads_a_plugin_provider_as_genai_spans(plugin: Path, toy: ToyServer,
                                                           tmp_path: Path) -> None:
    path = tmp_path / "toy.jsonl"
    recorded = record(toy, path)
    spans = exported_spans(plugin, path)
    assert [name for name, _ in spans][1:] == [f"chat {MODEL}", "execute_tool lookup"] * 2 + \
        [f"chat {MODEL}"]
    chats = [attrs for name, attrs in spans if name.startswith("chat ")]
    for attrs, counts, raw, finish in zip(chats, USAGES, recorded, ["call", "call", "done"],
                                          strict=True):
        assert {k: attrs[k] for k in (
            "gen_ai.provider.name", "gen_ai.request.model", "gen_ai.response.model",
            "gen_ai.response.id", "gen_ai.response.finish_reasons")} == {
            "gen_ai.provider.name": "toy", "gen_ai.request.model": MODEL,
            "gen_ai.response.model": MODEL, "gen_ai.response.id": answer_id(raw),
            "gen_ai.response.finish_reasons": [finish]}
        # the conventions count every input token, the cached ones apart as well
        assert attrs["gen_ai.usage.input_tokens"] == counts["input_tokens"] + 4
        assert attrs["gen_ai.usage.output_tokens"] == counts["output_tokens"]
        assert attrs["gen_ai.usage.cache_read.input_tokens"] == 4
        assert attrs["deja.cost_usd"] == cost(counts)
    assert "gen_ai.response.time_to_first_chunk" in chats[1]


# ------------------------------------------------------------------ the viewer


def test_deja_export_carries_a_plugin_providers_conversation(plugin: Path, toy: ToyServer,
                                                             tmp_path: Path) -> None:
    path = tmp_path / "toy.jsonl"
    record(toy, path)
    spans = exported_spans(plugin, path, "--content")
    chats = [attrs for name, attrs in spans if name.startswith("chat ")]
    tools = [attrs for name, attrs in spans if name.startswith("execute_tool ")]
    calls = [t for t in toy.requests[2]["turns"] if t["kind"] == "call"]
    results = [t for t in toy.requests[2]["turns"] if t["kind"] == "result"]
    assert json.loads(chats[2]["gen_ai.system_instructions"]) == [
        {"type": "text", "content": RULES}]
    said = json.loads(chats[2]["gen_ai.input.messages"])
    assert [(m["role"], [p["type"] for p in m["parts"]]) for m in said] == [
        ("user", ["text"]), ("assistant", ["text"]), ("assistant", ["tool_call"]),
        ("user", ["tool_call_response"]), ("assistant", ["text"]),
        ("assistant", ["tool_call"]), ("user", ["tool_call_response"])]
    assert said[2]["parts"][0] == {"type": "tool_call", "id": calls[0]["id"],
                                   "name": "lookup", "arguments": {"word": "deja"}}
    assert said[6]["parts"][0] == {"type": "tool_call_response", "id": results[1]["id"],
                                   "response": "again: French for 'already'"}
    reply = json.loads(chats[0]["gen_ai.output.messages"])
    assert reply == [{"role": "assistant", "finish_reason": "call", "parts": [
        {"type": "text", "content": "Looking up deja."},
        {"type": "tool_call", "id": calls[0]["id"], "name": "lookup",
         "arguments": {"word": "deja"}}]}]
    assert [t["gen_ai.tool.call.id"] for t in tools] == [c["id"] for c in calls]


def test_deja_stub_says_it_cannot_serve_a_plugin_provider(plugin: Path, toy: ToyServer,
                                                          tmp_path: Path) -> None:
    """The stub speaks the APIs it was written for; a plugin provider's run is served
    back by the proxy instead, and the stub says so."""
    path = tmp_path / "toy.jsonl"
    record(toy, path)
    done = deja(plugin, "stub", "--from", str(path), "-o", str(tmp_path / "script.json"),
                cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert not (tmp_path / "script.json").exists()
    assert "'toy'" in done.stderr and "deja proxy --replay" in done.stderr, done.stderr


def test_the_viewer_reads_a_toy_step_as_a_conversation(plugin: Path, toy: ToyServer,
                                                      tmp_path: Path) -> None:
    path = tmp_path / "toy.jsonl"
    record(toy, path)
    cassette = load(path)
    streamed, last = models(cassette)[1:]

    message = content.response_message(streamed)
    assert message is not None and content.is_streamed(streamed)
    assert message["turns"][0] == {"kind": "say", "text": "Looking up again."}
    assert message["turns"][1]["args"] == {"word": "again"}

    conv = content.conversation(cassette.request_of(last["seq"]), last, content.Clip())
    assert conv["model"] == MODEL
    assert [b["text"] for b in conv["system"]] == [RULES]
    assert [(m["role"], [b["type"] for b in m["blocks"]], m["new"])
            for m in conv["turns"]] == [
        ("user", ["text"], False), ("assistant", ["text"], False),
        ("assistant", ["tool_use"], False), ("user", ["tool_result"], False),
        ("assistant", ["text"], True), ("assistant", ["tool_use"], True),
        ("user", ["tool_result"], True)]
    call, result = conv["turns"][5]["blocks"][0], conv["turns"][6]["blocks"][0]
    assert (call["name"], call["input"]) == ("lookup", {"word": "again"})
    assert result["tool_use_id"] == call["id"] and result["name"] == "lookup"
    assert result["blocks"] == [{"type": "text", "text": "again: French for 'already'"}]
    response = conv["response"]
    assert response["stop_reason"] == "done" and response["usage"] == USAGES[2]
    assert response["model"] == MODEL and not response["streamed"]
    assert response["blocks"][0]["text"].startswith("Found: deja: French")
