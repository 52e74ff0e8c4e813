"""Replay cost per call of the openai SDK, beside the anthropic SDK's: deja against the
SDK's own floor, both OpenAI APIs (Chat Completions and Responses) in one run.

The workload is the replay rows' agent (:func:`workloads.agent_run`) spoken in Chat
Completions: conversations of ``workloads.CONV_TURNS`` calls whose history grows turn by
turn, the model calling ``search`` and ``read_file`` alternately (``tool_calls``), each
result sent back as a ``role: tool`` message, every request carrying the whole
conversation and both tool definitions. JSON replies (``chat.completions.create``) and
streams (``create(stream=True)``, every chunk iterated, text and tool-call arguments
assembled). Each reply is checked (the stub echoes the last user or tool text).

The same agent in the Responses API (:func:`responses_run`): each turn's reply goes back
as input items (the assistant's text, its ``function_call``), the tool's result as a
``function_call_output`` item, and every request carries all the items so far and both
tool definitions. JSON replies (``responses.create``) and streams (``create(stream=True)``,
every event iterated, the text deltas and each finished function call assembled).

- deja: ``replayer.replay(path)`` of a recording made with the openai SDK against the
  stub (one per API), which is stopped before any replay: the SDK's real HTTP path,
  answered at httpx2's transport.
- SDK floor: the same client with ``http_client=httpx2.Client(transport=MockTransport(...))``
  answering the recorded responses in order from memory, as the Anthropic floor does:
  request building, httpx2 and response parsing, no matching, no storage.
- Anthropic: deja and its floor on the anthropic workload of the same shape and size,
  measured in the same rounds, so the two providers' rows compare like for like.

Per call = (time of N calls) / N with a fresh client made inside the replay (construction
timed apart), load (the replay's ``__enter__``) excluded; median of ``repeats`` replays,
rounds rotated, after one untimed warm-up each.
"""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx2
import openai
import workloads as w

import recorder
import replayer

MODEL = "gpt-4.1"
MODES = ("json", "sse")
Run = Callable[[Any, int, bool], int]
TOOL_DEFS: list[Any] = [{"type": "function", "function": {"name": t["name"],
                                               "description": t["description"],
                                               "parameters": t["input_schema"]}}
             for t in w.TOOL_DEFS]
RESPONSE_TOOLS: list[Any] = [{"type": "function", "name": t["name"],
                              "description": t["description"],
                              "parameters": t["input_schema"]} for t in w.TOOL_DEFS]


def client(base_url: str, http_client: httpx2.Client | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=w.API_KEY,
                         http_client=http_client)


def _collect_stream(chunks: Any) -> tuple[str, list[dict[str, Any]]]:
    """Text and tool calls of a streamed chat completion, assembled from its chunks."""
    text: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                text.append(delta.content)
            for call in delta.tool_calls or []:
                slot = calls.setdefault(call.index, {"id": None, "name": None, "args": []})
                slot["id"] = call.id or slot["id"]
                if call.function is not None:
                    slot["name"] = call.function.name or slot["name"]
                    slot["args"].append(call.function.arguments or "")
    return "".join(text), [{"id": c["id"], "name": c["name"], "arguments": "".join(c["args"])}
                           for _, c in sorted(calls.items())]


def agent_call(c: openai.OpenAI, messages: list[Any],
               stream: bool) -> tuple[str, list[dict[str, Any]]]:
    """One chat call with the whole conversation; the reply's text and tool calls."""
    if stream:
        return _collect_stream(c.chat.completions.create(
            model=MODEL, max_completion_tokens=w.MAX_TOKENS, messages=messages,
            tools=TOOL_DEFS, stream=True))
    completion = c.chat.completions.create(model=MODEL, max_completion_tokens=w.MAX_TOKENS,
                                           messages=messages, tools=TOOL_DEFS)
    message = completion.choices[0].message
    calls: list[Any] = message.tool_calls or []
    return message.content or "", [{"id": t.id, "name": t.function.name,
                                    "arguments": t.function.arguments} for t in calls]


def conversation(c: openai.OpenAI, conv: int, turns: int, stream: bool) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": w.task_text(conv)}]
    for k in range(turns):
        text, calls = agent_call(c, list(messages), stream)
        want = f"ok {messages[-1]['content']}"
        want_tools = [] if k == turns - 1 else [w.TOOLS[k % 2]]
        if text != want or [t["name"] for t in calls] != want_tools:
            raise RuntimeError(f"conversation {conv}, call {k}: unexpected reply {text[:60]!r} "
                               f"with tools {[t['name'] for t in calls]}")
        assistant: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            assistant["tool_calls"] = [
                {"id": t["id"], "type": "function",
                 "function": {"name": t["name"], "arguments": t["arguments"]}} for t in calls]
        messages.append(assistant)
        if calls:
            json.loads(calls[0]["arguments"])  # the arguments arrived whole
            messages.append({"role": "tool", "tool_call_id": calls[0]["id"],
                             "content": w.tool_output(conv, k)})


def agent_run(c: openai.OpenAI, n_calls: int, stream: bool) -> int:
    if n_calls % w.CONV_TURNS:
        raise ValueError(f"n_calls={n_calls} is not a multiple of {w.CONV_TURNS}")
    for conv in range(n_calls // w.CONV_TURNS):
        conversation(c, conv, w.CONV_TURNS, stream)
    return n_calls


def _collect_events(events: Any) -> tuple[str, list[dict[str, Any]]]:
    """Text and function calls of a streamed Responses call, assembled from its events."""
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    for event in events:
        if event.type == "response.output_text.delta":
            text.append(event.delta)
        elif event.type == "response.output_item.done" and event.item.type == "function_call":
            calls.append({"id": event.item.call_id, "name": event.item.name,
                          "arguments": event.item.arguments})
    return "".join(text), calls


def responses_call(c: openai.OpenAI, items: list[Any],
                   stream: bool) -> tuple[str, list[dict[str, Any]]]:
    """One Responses call with all the conversation's items; the reply's text and calls."""
    if stream:
        return _collect_events(c.responses.create(
            model=MODEL, max_output_tokens=w.MAX_TOKENS, input=items, tools=RESPONSE_TOOLS,
            stream=True))
    response = c.responses.create(model=MODEL, max_output_tokens=w.MAX_TOKENS, input=items,
                                  tools=RESPONSE_TOOLS)
    return response.output_text, [{"id": o.call_id, "name": o.name, "arguments": o.arguments}
                                  for o in response.output if o.type == "function_call"]


def responses_conversation(c: openai.OpenAI, conv: int, turns: int, stream: bool) -> None:
    last = w.task_text(conv)
    items: list[dict[str, Any]] = [{"role": "user", "content": last}]
    for k in range(turns):
        text, calls = responses_call(c, list(items), stream)
        want_tools = [] if k == turns - 1 else [w.TOOLS[k % 2]]
        if text != f"ok {last}" or [t["name"] for t in calls] != want_tools:
            raise RuntimeError(f"conversation {conv}, call {k}: unexpected reply {text[:60]!r} "
                               f"with tools {[t['name'] for t in calls]}")
        items.append({"role": "assistant", "content": text})
        for t in calls:
            json.loads(t["arguments"])  # the arguments arrived whole
            items.append({"type": "function_call", "call_id": t["id"], "name": t["name"],
                          "arguments": t["arguments"]})
        if calls:
            last = w.tool_output(conv, k)
            items.append({"type": "function_call_output", "call_id": calls[0]["id"],
                          "output": last})


def responses_run(c: openai.OpenAI, n_calls: int, stream: bool) -> int:
    if n_calls % w.CONV_TURNS:
        raise ValueError(f"n_calls={n_calls} is not a multiple of {w.CONV_TURNS}")
    for conv in range(n_calls // w.CONV_TURNS):
        responses_conversation(c, conv, w.CONV_TURNS, stream)
    return n_calls


def floor_client(answers: list[tuple[int, list[tuple[str, str]], bytes]],
                 base_url: str) -> openai.OpenAI:
    """The openai SDK's floor: its whole HTTP path answered in order from memory, at the
    replays' ``base_url``."""
    it = iter(answers)

    def handle(request: httpx2.Request) -> httpx2.Response:
        status, headers, body = next(it)
        return httpx2.Response(status, headers=headers, content=body)

    return client(base_url, httpx2.Client(transport=httpx2.MockTransport(handle)))




def _timed(enter: Callable[[], Any], leave: Callable[[], None], make_client: Callable[[], Any],
           run: Run, n: int, stream: bool) -> dict[str, float]:
    t0 = time.perf_counter()
    enter()
    t1 = time.perf_counter()
    try:
        c = make_client()
        t1c = time.perf_counter()
        done = run(c, n, stream)
        t2 = time.perf_counter()
    finally:
        leave()
    return {"load_s": t1 - t0, "client_s": t1c - t1, "calls_s": t2 - t1c,
            "per_call_s": (t2 - t1c) / done}


def _deja(path: Path, make_client: Callable[[], Any], run: Run, n: int,
          stream: bool) -> dict[str, float]:
    cm = replayer.replay(path, raise_on_divergence=False)
    out = _timed(cm.__enter__, lambda: cm.__exit__(None, None, None), make_client, run, n,
                 stream)
    if cm.result is None or cm.result.divergence is not None:
        raise RuntimeError(f"deja replay diverged: {cm.result and cm.result.report()}")
    return out


def _record(d: Path, mode: str, n: int) -> tuple[str, dict[str, Path], dict[str, list[Any]]]:
    """Both providers' runs (both OpenAI APIs) recorded by deja, and their responses
    captured for the floor."""
    stream = mode == "sse"
    paths: dict[str, Path] = {}
    answers: dict[str, list[Any]] = {}
    with w.stub(w.agent_script(w.CONV_TURNS)) as server:
        url = server.url
        runs: tuple[tuple[str, Callable[[str], Any], Run], ...] = (
            ("openai", client, agent_run), ("responses", client, responses_run),
            ("anthropic", w.client, _anthropic_run))
        for name, make, run in runs:
            paths[name] = p = d / f"{name}-{mode}-{n}.jsonl"
            with recorder.record(p, budgets=recorder.Budgets()):
                run(make(url), n, stream)
            w.assert_unpatched(f"after the {name} recording")
            cap = w.Capture(url)
            try:
                transport = httpx2.Client(transport=httpx2.MockTransport(cap._handle))
                run(cap.client() if name == "anthropic" else client(url, transport), n,
                    stream)
            finally:
                cap.close()
            answers[name] = cap.responses
    return url, paths, answers


def _anthropic_run(c: Any, n: int, stream: bool) -> int:
    return w.agent_run(c, n, stream=stream)


def _summary(samples: list[dict[str, float]]) -> dict[str, Any]:
    return {"per_call_ms": w.ms(w.median([s["per_call_s"] for s in samples])),
            "load_ms": w.ms(w.median([s["load_s"] for s in samples])),
            "client_ms": w.ms(w.median([s["client_s"] for s in samples])),
            "samples_per_call_ms": [round(w.ms(s["per_call_s"]), 4) for s in samples],
            "repeats": len(samples)}


def _run_mode(d: Path, mode: str, n: int, repeats: int) -> dict[str, Any]:
    stream = mode == "sse"
    url, paths, answers = _record(d, mode, n)
    # The stub is stopped: from here on nothing answers at `url`.
    runners: dict[str, Callable[[], dict[str, float]]] = {
        "openai": lambda: _deja(paths["openai"], lambda: client(url), agent_run, n, stream),
        "openai_floor": lambda: _timed(lambda: None, lambda: None,
                                       lambda: floor_client(answers["openai"], url), agent_run, n,
                                       stream),
        "responses": lambda: _deja(paths["responses"], lambda: client(url), responses_run, n,
                                   stream),
        "responses_floor": lambda: _timed(lambda: None, lambda: None,
                                          lambda: floor_client(answers["responses"], url),
                                          responses_run, n, stream),
        "anthropic": lambda: _deja(paths["anthropic"], lambda: w.client(url), _anthropic_run,
                                   n, stream),
        "anthropic_floor": lambda: _timed(lambda: None, lambda: None,
                                          lambda: w.floor_client(answers["anthropic"], url),
                                          _anthropic_run, n, stream),
    }
    for run in runners.values():
        run()  # warm-up
    samples: dict[str, list[dict[str, float]]] = {k: [] for k in runners}
    for _, order in w.rounds(repeats, list(runners)):
        for k in order:
            gc.collect()
            samples[k].append(runners[k]())
    w.assert_unpatched(f"after the {mode} replays")
    out: dict[str, Any] = {k: _summary(v) for k, v in samples.items()}
    per = {k: out[k]["per_call_ms"] for k in runners}
    out["ratio"] = {"openai_floor": per["openai"] / per["openai_floor"],
                    "responses_floor": per["responses"] / per["responses_floor"],
                    "anthropic_floor": per["anthropic"] / per["anthropic_floor"],
                    "openai_vs_anthropic": per["openai"] / per["anthropic"]}
    out["cassette_bytes"] = {k: p.stat().st_size for k, p in paths.items()}
    return out


def run(*, n: int = 200, repeats: int = 5) -> dict[str, Any]:
    out: dict[str, Any] = {"calls": n, "conv_turns": w.CONV_TURNS, "model": MODEL,
                           "openai_version": openai.__version__}
    with w.measurement("openai replay"), w.tempdir("openai-replay") as d:
        for mode in MODES:
            out[mode] = _run_mode(d, mode, n, repeats)
    return out
