"""How a run of ``deja proxy`` ends, and which format reads its requests: a real proxy
process forwarding to the stub server (or to a made-up API's own server), with the real
SDKs.

A run left idle, or open when the proxy shuts down, ends ``interrupted`` when its last
reply asked for tools whose results never came, and ``completed`` when that reply ended
the turn, whatever its provider's stop reason says: Gemini stops a reply that calls a
function with ``STOP``, an OpenAI-compatible server may finish one with ``stop``,
Anthropic's says ``tool_use``. Every successful reply is read by its provider for that.

A request is read by the provider its URL names, never guessed from its body: a plugin
API whose requests OpenAI's Chat Completions format reads too (``messages``,
``tool_calls``, ``role: tool``), but whose calls carry no id and whose results name their
tool, has its tool results read, logged and checked as its own format says.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import anthropic
import httpx2
import openai
import pytest
from gemini_helpers import function_config
from google import genai
from google.genai import types
from proxy_helpers import ProxyProcess, cassettes, lines, load_verified

from recorder.cassette import Cassette
from recorder.testing.server import StubServer

Proxy = Callable[..., ProxyProcess]
Stub = Callable[[dict], StubServer]

CLAUDE = "claude-sonnet-4-6"
GEMINI = "gemini-2.5-flash"
GPT = "gpt-4o-mini"
KEYS = {"anthropic": "sk-ant-test-ENDS-4f1c9e", "openai": "sk-test-ENDS-0123456789",
        "gemini": "AIzaSyD-deja-proxy-ENDS-0123456789ab"}
# A call, then an answer: a conversation of two model calls when the agent sends the result.
TOOL_THEN_TEXT = {"select": "conversation", "turns": [
    {"text": "Let me look.", "tool_use": {"name": "lookup", "input": {"word": "deja"}}},
    {"text": "It means already."}]}
GEMINI_CONFIG = function_config("lookup", "word", "Look a word up.")
OPENAI_TOOLS: list[Any] = [{"type": "function", "function": {
    "name": "lookup", "description": "Look a word up.",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}}}}}]


# ============================================== three agents: each asks, then maybe answers


def gemini_agent(url: str, answer: bool, stream: bool = False) -> None:
    """A google-genai chat (it keeps its own history): ask, and with ``answer`` send each
    function's response until the model answers in text; else leave it asking."""
    with genai.Client(api_key=KEYS["gemini"],
                      http_options=types.HttpOptions(base_url=url)) as client:
        chat = client.chats.create(model=GEMINI, config=GEMINI_CONFIG)
        message: Any = "What does 'deja' mean?"
        while True:
            chunks = list(chat.send_message_stream(message)) if stream \
                else [chat.send_message(message)]
            calls = [call for chunk in chunks for call in chunk.function_calls or []]
            if not calls or not answer:
                return
            message = [types.Part.from_function_response(name=call.name or "",
                                                         response={"meaning": "already"})
                       for call in calls]


def anthropic_agent(url: str, answer: bool) -> None:
    """The Messages API's tool loop."""
    messages: list[Any] = [{"role": "user", "content": "What does 'deja' mean?"}]
    with anthropic.Anthropic(base_url=url, api_key=KEYS["anthropic"], max_retries=0) as c:
        while True:
            reply = c.messages.create(model=CLAUDE, max_tokens=256, messages=messages)
            uses = [b for b in reply.content if b.type == "tool_use"]
            if not uses or not answer:
                return
            messages += [{"role": "assistant", "content": [
                b.model_dump(mode="json", exclude_none=True) for b in reply.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": b.id,
                                              "content": "already"} for b in uses]}]


def openai_agent(url: str, answer: bool) -> None:
    """A Chat Completions tool loop against a server that finishes a reply that calls
    tools with ``stop``, as some OpenAI-compatible servers do."""
    messages: list[Any] = [{"role": "user", "content": "What does 'deja' mean?"}]
    with openai.OpenAI(base_url=f"{url}/v1", api_key=KEYS["openai"], max_retries=0) as c:
        while True:
            reply = c.chat.completions.create(model=GPT, messages=messages, tools=OPENAI_TOOLS)
            choice = reply.choices[0]
            if not choice.message.tool_calls or not answer:
                assert choice.finish_reason == "stop"
                return
            messages += [choice.message.model_dump(mode="json", exclude_none=True)]
            messages += [{"role": "tool", "tool_call_id": call.id, "content": "already"}
                         for call in choice.message.tool_calls]


AGENTS = {"gemini": (gemini_agent, "STOP"), "anthropic": (anthropic_agent, "tool_use"),
          "openai": (openai_agent, "stop")}


def script_for(provider: str) -> dict[str, Any]:
    """The stub's script: the OpenAI-compatible server says ``stop`` of its tool call."""
    if provider != "openai":
        return TOOL_THEN_TEXT
    first, last = TOOL_THEN_TEXT["turns"]
    return {**TOOL_THEN_TEXT, "turns": [{**first, "stop_reason": "end_turn"}, last]}


def ended(directory: Path, count: int, timeout: float = 30.0) -> list[Cassette]:
    """The ``count`` cassettes of ``directory`` once each has its end line."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        runs = [load_verified(path) for path in cassettes(directory)]
        if len(runs) == count and all(run.end is not None for run in runs):
            return runs
        time.sleep(0.05)
    raise AssertionError(f"{count} runs did not end in {directory} within {timeout}s")


def by_calls(runs: list[Cassette]) -> dict[int, Cassette]:
    """The runs by how many model calls each made."""
    return {sum(o["kind"] == "model" for o in run.observations): run for run in runs}


# ========================================================= how a run ends


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_gemini_run_left_idle_with_a_function_call_pending_is_interrupted(
        proxy: Proxy, stub: Stub, tmp_path: Path, stream: bool) -> None:
    """Its last reply stopped with ``STOP``, as the one that ended the other run did: its
    ``functionCall`` is what says the turn was not over."""
    upstream = stub(TOOL_THEN_TEXT)
    directory = tmp_path / "runs"
    recording = proxy("--upstream", upstream.url, "--dir", str(directory), "--idle", "1")
    gemini_agent(recording.url, answer=True, stream=stream)
    gemini_agent(recording.url, answer=False, stream=stream)  # walks away from the call
    runs = by_calls(ended(directory, 2))
    assert recording.process.poll() is None  # closed by the idle timer, not a shutdown
    status, log = recording.stop()
    assert status == 0, log
    assert "idle for 1s" in log

    done, left = runs[2], runs[1]
    assert [o["kind"] for o in lines(done)] == ["model", "tool", "model"]
    assert [o["kind"] for o in lines(left)] == ["model"]
    assert [o["stop_reason"] for o in (*done.observations, *left.observations)
            if o["kind"] == "model"] == ["STOP"] * 3
    assert done.end is not None and done.end["status"] == "completed"
    assert left.end is not None and left.end["status"] == "interrupted"


@pytest.mark.parametrize("provider", sorted(AGENTS))
def test_a_run_open_at_shutdown_with_a_tool_call_pending_is_interrupted(
        proxy: Proxy, stub: Stub, tmp_path: Path, provider: str) -> None:
    """Every provider alike: the run whose last reply asked for a tool is interrupted,
    the one whose last reply answered is completed, whatever their stop reasons say."""
    agent, asked = AGENTS[provider]
    upstream = stub(script_for(provider))
    directory = tmp_path / "runs"
    recording = proxy("--upstream", upstream.url, "--dir", str(directory))
    agent(recording.url, answer=True)
    agent(recording.url, answer=False)
    status, log = recording.stop()  # every open run is closed with its end line
    assert status == 0, log
    runs = by_calls(ended(directory, 2, timeout=5.0))

    done, left = runs[2], runs[1]
    assert [o["kind"] for o in lines(done)] == ["model", "tool", "model"]
    [pending] = [o for o in lines(left) if o["kind"] == "model"]
    assert pending["stop_reason"] == asked
    assert done.end is not None and done.end["status"] == "completed"
    assert left.end is not None and left.end["status"] == "interrupted", log


# ================================= a request is read by the provider its URL names


PLUGIN = '''"""A chat API shaped like Ollama's ``/api/chat``: ``messages`` as Chat Completions
sends them, but a call carries no id (its result names its tool) and a reply says ``stop``
whether or not it calls tools."""

import json

from recorder.providers import Carriage, Format, Provider, token_counts


def _turn(message):
    if message.get("role") == "tool":
        return {"role": "user", "content": [{
            "type": "tool_result", "tool_use_id": message.get("tool_name"),
            "name": message.get("tool_name"), "content": message.get("content")}]}
    blocks = [{"type": "text", "text": message["content"]}] if message.get("content") else []
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        blocks.append({"type": "tool_use", "id": function.get("name"),
                       "name": function.get("name"), "input": function.get("arguments")})
    return {"role": message.get("role"), "content": blocks}


class LlamaFormat(Format):
    volatile_message_keys = ("created_at",)

    def assemble(self, text):
        return json.loads(text.strip().splitlines()[-1])

    def synthesize(self, message):
        return json.dumps(message) + "\\n"

    def usage(self, message):
        return token_counts({"input_tokens": message.get("prompt_eval_count"),
                             "output_tokens": message.get("eval_count")})

    def stop_reason(self, message):
        return message.get("done_reason") if isinstance(message, dict) else None

    def summarize_json(self, status, doc):
        if not isinstance(doc, dict):
            return {}
        if status >= 400:
            return {"error": {"type": "error", "message": doc.get("error")}}
        return {"model": doc.get("model"), "stop_reason": self.stop_reason(doc),
                "usage": self.usage(doc)}

    def summarize_stream(self, text):
        try:
            return self.summarize_json(200, self.assemble(text))
        except (ValueError, IndexError):
            return {}

    def conversation(self, request, message=None):
        body = request if isinstance(request, dict) else {}
        reply = message.get("message") if isinstance(message, dict) else None
        return {"system": None,
                "messages": [_turn(m) for m in body.get("messages") or []
                             if isinstance(m, dict)],
                "reply": _turn({**reply, "role": "assistant"})
                if isinstance(reply, dict) else None,
                "settings": {k: v for k, v in body.items() if k != "messages"}}

    def tool_result_slots(self, body):
        return [(m, "content") for m in body.get("messages") or []
                if isinstance(m, dict) and m.get("role") == "tool"]


def provider():
    return Provider("llama", LlamaFormat(), Carriage(("/api/chat",)))
'''


@pytest.fixture
def plugin(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The ``llama`` provider installed as pip installs a package (its module and a
    ``dist-info`` naming it in the ``deja.providers`` entry point group): the environment
    of a deja process that has it."""
    site = tmp_path_factory.mktemp("site-packages")
    (site / "llama_deja.py").write_text(PLUGIN)
    info = site / "llama_deja-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: llama-deja\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[deja.providers]\nllama = llama_deja:provider\n")
    paths = [str(site), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {"PYTHONPATH": os.pathsep.join(paths)}


class LlamaServer:
    """The made-up API's server: a call of ``lookup`` until the request holds a result,
    then an answer; every reply says ``stop``."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        received = self.requests

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                received.append(body)
                answered = any(m.get("role") == "tool" for m in body["messages"])
                message = {"role": "assistant", "content": "It means already."} if answered \
                    else {"role": "assistant", "content": "", "tool_calls": [
                        {"function": {"name": "lookup", "arguments": {"word": "deja"}}}]}
                data = json.dumps({"model": body["model"], "created_at": time.time(),
                                   "message": message, "done": True, "done_reason": "stop",
                                   "prompt_eval_count": 10, "eval_count": 5}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()


@pytest.fixture
def llama() -> Iterator[LlamaServer]:
    server = LlamaServer()
    yield server
    server.stop()


def llama_loop(url: str, meaning: str = "already") -> list[dict[str, Any]]:
    """The made-up API's tool loop, over plain HTTP: every reply."""
    messages: list[Any] = [{"role": "user", "content": "What does 'deja' mean?"}]
    replies = []
    with httpx2.Client(base_url=url, timeout=30) as client:
        while True:
            response = client.post("/api/chat", json={"model": "llama3.2", "stream": False,
                                                      "messages": messages})
            response.raise_for_status()
            reply = response.json()
            replies.append(reply)
            calls = reply["message"].get("tool_calls")
            if not calls:
                return replies
            messages += [reply["message"], *({"role": "tool", "content": meaning,
                                              "tool_name": c["function"]["name"]}
                                             for c in calls)]


def test_a_request_is_read_by_the_provider_its_url_names(
        proxy: Proxy, llama: LlamaServer, plugin: dict[str, str], tmp_path: Path) -> None:
    """OpenAI's format reads the plugin's requests as many tool calls and results as the
    plugin's does, but with no ids: read by a guess from the body, the result was no tool
    step; read by the provider ``/api/chat`` names, it is one, and a replay checks it."""
    directory = tmp_path / "runs"
    recording = proxy("--upstream", llama.url, "--dir", str(directory), env=plugin)
    replies = llama_loop(recording.url)
    status, log = recording.stop()
    assert status == 0, log
    assert [r["message"]["content"] for r in replies] == ["", "It means already."]

    [path] = cassettes(directory)
    cassette = load_verified(path)
    steps = lines(cassette)
    assert [(o["kind"], o.get("provider")) for o in steps] == [
        ("model", "llama"), ("tool", None), ("model", "llama")]
    tool = steps[1]
    assert (tool["name"], tool["args"], tool["result"], tool["call_id"], tool["observed"]) \
        == ("lookup", {"word": "deja"}, "already", "lookup", "proxy")
    assert cassette.end is not None and cassette.end["status"] == "completed"

    llama.stop()  # the replay is served from the cassette alone
    replaying = proxy("--replay", str(path), env=plugin)
    assert llama_loop(replaying.url) == replies
    status, log = replaying.stop()
    assert status == 0, log
    assert ": identical" in log and "steps:      3/3 served" in log, log

    replaying = proxy("--replay", str(path), env=plugin)
    with pytest.raises(httpx2.HTTPStatusError) as refused:
        llama_loop(replaying.url, meaning="never")
    said = refused.value.response.json()["error"]["message"]
    assert "diverged from the recording at step 1 (tool)" in said, said
    assert "'lookup' returned something other than the recorded result" in said
    status, log = replaying.stop()
    assert status == 1, log
