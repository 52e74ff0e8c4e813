"""Shared workload for the benchmarks: the real anthropic SDK against deja's stub server.

Everything here is offline (127.0.0.1). A measurement starts its own stub server and
stops it when done: in a thread of this process (:func:`stub`), or in a process of its own
(:func:`stub_process`) where a row times what the agent's process does while the model
answers, as a remote API would; it works in its own temporary directory (:func:`tempdir`),
and checks before and after that no HTTP patches (deja's or vcrpy's) are left active
(:func:`assert_unpatched`), so deja, vcrpy and agent-rewind are never measured on top of each
other. The SDK's floor (:func:`floor_client`) answers the same calls from memory through an
in-process transport: the cost of the SDK's own HTTP path, which no replay through it beats.
"""

from __future__ import annotations

import contextlib
import gc
import http.client
import json
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx2

import recorder
from recorder.testing.server import StubServer

MODEL = "claude-sonnet-4-6"
API_KEY = "sk-bench"
MAX_TOKENS = 64
ECHO_SCRIPT = {"default": {"text": "ok {echo}"}}

# The transport methods deja and vcrpy patch, and the SDK methods agent-rewind patches, as
# they are with nothing installed.
_PRISTINE: dict[str, Any] = {
    "httpx2.HTTPTransport.handle_request": httpx2.HTTPTransport.handle_request,
    "httpx2.AsyncHTTPTransport.handle_async_request":
        httpx2.AsyncHTTPTransport.handle_async_request,
    "http.client.HTTPConnection": http.client.HTTPConnection,
    "http.client.HTTPSConnection": http.client.HTTPSConnection,
    "anthropic Messages.create": anthropic.resources.messages.Messages.create,
    "anthropic Messages.stream": anthropic.resources.messages.Messages.stream,
}


def _current() -> dict[str, Any]:
    return {
        "httpx2.HTTPTransport.handle_request": httpx2.HTTPTransport.handle_request,
        "httpx2.AsyncHTTPTransport.handle_async_request":
            httpx2.AsyncHTTPTransport.handle_async_request,
        "http.client.HTTPConnection": http.client.HTTPConnection,
        "http.client.HTTPSConnection": http.client.HTTPSConnection,
        "anthropic Messages.create": anthropic.resources.messages.Messages.create,
        "anthropic Messages.stream": anthropic.resources.messages.Messages.stream,
    }


def assert_unpatched(where: str) -> None:
    """Fail loudly if a deja session, a vcrpy cassette or agent-rewind's SDK patch is still
    installed."""
    changed = [name for name, obj in _current().items() if obj is not _PRISTINE[name]]
    if changed or recorder.active() is not None:
        raise RuntimeError(f"{where}: HTTP patches still active ({changed or 'deja session'}); "
                           "a previous measurement leaked its patches")


def prompt(i: int) -> str:
    """A small prompt, distinct per call, so that every request fingerprint differs."""
    return f"bench prompt {i}: name one prime above {i}"


def client(base_url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key=API_KEY)


def call(c: anthropic.Anthropic, i: int) -> Any:
    return c.messages.create(model=MODEL, max_tokens=MAX_TOKENS,
                             messages=[{"role": "user", "content": prompt(i)}])


def check_echo(messages: list[Any], indices: list[int] | range) -> None:
    """Every response is the stub's echo of its own prompt (served or replayed right)."""
    for msg, i in zip(messages, indices, strict=True):
        text = msg.content[0].text
        if text != f"ok {prompt(i)}":
            raise RuntimeError(f"call {i}: unexpected response text {text!r}")


def calls(c: anthropic.Anthropic, indices: list[int] | range) -> list[Any]:
    return [call(c, i) for i in indices]


def timed_calls(c: anthropic.Anthropic,
                indices: list[int] | range) -> tuple[list[float], list[Any]]:
    """Per-call wall times (seconds) and the responses."""
    times, out = [], []
    for i in indices:
        t0 = time.perf_counter()
        out.append(call(c, i))
        times.append(time.perf_counter() - t0)
    return times, out


@contextlib.contextmanager
def stub(script: dict[str, Any] | None = None) -> Iterator[StubServer]:
    """A stub Anthropic server for one measurement; always stopped."""
    server = StubServer(script or ECHO_SCRIPT).start()
    try:
        yield server
    finally:
        server.stop()


def wait_file(path: Path, proc: subprocess.Popen[bytes], log: Path, what: str) -> str:
    """The text of ``path`` once ``proc`` (``what``, writing to ``log``) has written it."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if path.is_file():
            return path.read_text()
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{log.read_text()}")
        time.sleep(0.01)
    proc.kill()
    proc.wait()
    raise RuntimeError(f"{what} did not listen within 30 s:\n{log.read_text()}")


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        return proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


@contextlib.contextmanager
def stub_process(d: Path, script: dict[str, Any] | None = None) -> Iterator[str]:
    """``python -m deja stub`` serving ``script`` in a process of its own, which shares
    neither this process's interpreter lock nor its CPU time; yields its base URL."""
    spec, ready, log = d / "stub.json", d / "stub.ready", d / "stub.log"
    spec.write_text(json.dumps(script or ECHO_SCRIPT))
    ready.unlink(missing_ok=True)
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "deja", "stub", "--script", str(spec),
                                 "--port", "0", "--ready-file", str(ready)],
                                stdout=out, stderr=subprocess.STDOUT, cwd=d)
    try:
        yield wait_file(ready, proc, log, "deja stub").strip()
    finally:
        stop(proc)


@contextlib.contextmanager
def tempdir(name: str) -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix=f"deja-bench-{name}-") as d:
        yield Path(d)


@contextlib.contextmanager
def measurement(name: str) -> Iterator[None]:
    """Bracket a measurement: no patches leaked in or out, garbage collected first."""
    assert_unpatched(f"before {name}")
    gc.collect()
    try:
        yield
    finally:
        assert_unpatched(f"after {name}")


def vcr_instance(record_mode: str) -> Any:
    """vcrpy as a user would set it up: record with its defaults (record_mode="all"; the
    matchers do not change what is recorded), replay matching method, URI and body (the
    requests all go to one URI, so the body is what tells them apart)."""
    import vcr

    if record_mode == "none":
        return vcr.VCR(record_mode="none", match_on=["method", "uri", "body"])
    return vcr.VCR(record_mode=record_mode)


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def ms(seconds: float) -> float:
    return seconds * 1000.0


def rounds(n: int, order: list[str]) -> Iterator[tuple[int, list[str]]]:
    """``n`` rounds of ``order``, rotated each round so no variant always runs first."""
    for r in range(n):
        k = r % len(order)
        yield r, order[k:] + order[:k]


def run_blocks(blocks: dict[str, Callable[[], None]], n_rounds: int) -> None:
    for _, order in rounds(n_rounds, list(blocks)):
        for name in order:
            gc.collect()
            blocks[name]()


# ---------------------------------------------------------------------------- agent workload
#
# Conversations shaped like an agent's: a task, then turn after turn the model calls a tool
# (``search`` and ``read_file`` alternately), the tool's result goes back as the next user
# message, and every request carries the whole conversation so far; the last turn of a
# conversation is a plain text answer. Many such conversations make up a run, so a run of
# N calls has the same per-call request sizes whatever N is.

TOOLS = ("search", "read_file")
TOOL_DEFS = [
    {"name": "search", "description": "Search the knowledge base.",
     "input_schema": {"type": "object", "properties": {"query": {"type": "string"}},
                      "required": ["query"]}},
    {"name": "read_file", "description": "Read a file of the workspace.",
     "input_schema": {"type": "object", "properties": {"path": {"type": "string"}},
                      "required": ["path"]}},
]
CONV_TURNS = 20  # model calls per conversation in the replay and overhead runs


def _tool_input(k: int) -> dict[str, str]:
    return {"query": f"q{k}"} if k % 2 == 0 else {"path": f"src/file{k}.py"}


def agent_script(turns: int, echo: bool = True) -> dict[str, Any]:
    """The stub's script: turn k (the k-th call of a conversation) calls tool k % 2 with a
    fixed input and id; the last turn answers in text. With ``echo`` each reply's text is
    ``ok <last user message>``, so a reply served for the wrong request shows."""
    out = []
    for k in range(turns):
        text = "ok {echo}" if echo else f"step {k} done"
        turn: dict[str, Any] = {"text": text}
        if k < turns - 1:
            turn["tool_use"] = {"name": TOOLS[k % 2], "input": _tool_input(k),
                                "id": f"toolu_{k:06d}"}
        out.append(turn)
    return {"select": "conversation", "turns": out}


def task_text(conv: int) -> str:
    return f"Task {conv}: find why the nightly build of module m{conv % 17} fails, and fix it."


def tool_output(conv: int, k: int, chars: int = 0) -> str:
    """The result of tool call k of conversation ``conv``; about ``chars`` long if given."""
    base = (f"conversation {conv}, call {k}: {TOOLS[k % 2]} returned {(conv * 7 + k) % 23 + 1} "
            f"rows; the newest mentions m{(conv + k) % 17}.")
    if chars <= len(base):
        return base
    filler = " ".join(f"row{k}-{j}=value{(conv * 31 + k * 7 + j) % 97}"
                      for j in range(chars // 12))
    return (base + " " + filler)[:chars]


def _collect_stream(events: Any) -> tuple[str, list[dict[str, Any]]]:
    """Text and tool_use blocks of a streamed reply, assembled from its raw events."""
    text: list[str] = []
    tools: list[dict[str, Any]] = []
    partial: dict[int, list[str]] = {}
    for ev in events:
        kind = ev.type
        if kind == "content_block_delta":
            delta = ev.delta
            if delta.type == "text_delta":
                text.append(delta.text)
            elif delta.type == "input_json_delta":
                partial[ev.index].append(delta.partial_json)
        elif kind == "content_block_start" and ev.content_block.type == "tool_use":
            block = ev.content_block
            tools.append({"type": "tool_use", "id": block.id, "name": block.name, "input": {}})
            partial[ev.index] = []
        elif kind == "content_block_stop" and ev.index in partial:
            raw = "".join(partial.pop(ev.index))
            tools[-1]["input"] = json.loads(raw) if raw else {}
    return "".join(text), tools


def agent_call(c: anthropic.Anthropic, messages: list[dict[str, Any]], stream: bool,
               max_tokens: int = MAX_TOKENS) -> tuple[str, list[dict[str, Any]]]:
    """One model call with the whole conversation; the reply's text and tool_use blocks."""
    if stream:
        events = c.messages.create(model=MODEL, max_tokens=max_tokens, messages=messages,
                                   tools=TOOL_DEFS, stream=True)
        return _collect_stream(events)
    msg = c.messages.create(model=MODEL, max_tokens=max_tokens, messages=messages,
                            tools=TOOL_DEFS)
    text = "".join(b.text for b in msg.content if b.type == "text")
    tools = [{"type": "tool_use", "id": b.id, "name": b.name, "input": b.input}
             for b in msg.content if b.type == "tool_use"]
    return text, tools


def conversation(c: anthropic.Anthropic, conv: int, turns: int, *, stream: bool = False,
                 chars: int = 0, echo: bool = True, times: list[float] | None = None) -> None:
    """Run conversation ``conv`` of ``turns`` model calls, checking every reply; each call's
    wall time goes into ``times`` if given."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": task_text(conv)}]
    for k in range(turns):
        t0 = time.perf_counter()
        text, tools = agent_call(c, list(messages), stream)
        if times is not None:
            times.append(time.perf_counter() - t0)
        last = messages[-1]["content"]
        last_text = last if isinstance(last, str) else last[0]["content"]
        want = f"ok {last_text}" if echo else f"step {k} done"
        want_tools = [] if k == turns - 1 else [TOOLS[k % 2]]
        if text != want or [t["name"] for t in tools] != want_tools:
            raise RuntimeError(f"conversation {conv}, call {k}: unexpected reply {text[:60]!r} "
                               f"with tools {[t['name'] for t in tools]}")
        messages.append({"role": "assistant",
                         "content": [{"type": "text", "text": text}, *tools]})
        if tools:
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": tools[0]["id"],
                 "content": tool_output(conv, k, chars)}]})


# The agent as most are written: each answer goes back as the SDK returned it
# (``msg.content``, the SDK's own blocks, which it serialises in its own field order), its
# tool-use ids are the server's (random), and every task and tool result carries a nonce, so
# no two runs, and no two turns, send the same bytes.


def sdk_script(turns: int) -> dict[str, Any]:
    """The stub's script for :func:`sdk_conversation`: turn k answers ``ok <last user
    text>`` (which repeats its nonce) and calls tool k % 2 with an id of the stub's making;
    the last turn answers in text alone."""
    out = []
    for k in range(turns):
        turn: dict[str, Any] = {"text": "ok {echo}"}
        if k < turns - 1:
            turn["tool_use"] = {"name": TOOLS[k % 2], "input": _tool_input(k)}
        out.append(turn)
    return {"select": "conversation", "turns": out}


def sdk_conversation(c: anthropic.Anthropic, conv: int, turns: int, *, chars: int = 0,
                     times: list[float] | None = None) -> None:
    """Conversation ``conv`` of ``turns`` calls against :func:`sdk_script`, each answer
    (text + tool_use) sent back as ``msg.content`` and each tool result with a fresh
    nonce; every reply is checked."""
    nonce = secrets.token_hex(8)
    messages: list[dict[str, Any]] = [{"role": "user",
                                       "content": f"{task_text(conv)} (nonce {nonce})"}]
    for k in range(turns):
        t0 = time.perf_counter()
        msg = c.messages.create(model=MODEL, max_tokens=MAX_TOKENS, messages=list(messages),
                                tools=TOOL_DEFS)
        if times is not None:
            times.append(time.perf_counter() - t0)
        calls = [b for b in msg.content if b.type == "tool_use"]
        want_tools = [] if k == turns - 1 else [TOOLS[k % 2]]
        if nonce not in msg.content[0].text or [b.name for b in calls] != want_tools:
            raise RuntimeError(f"conversation {conv}, call {k}: unexpected reply "
                               f"{msg.content[0].text[:60]!r} with tools "
                               f"{[b.name for b in calls]}")
        messages.append({"role": "assistant", "content": msg.content})
        if calls:
            nonce = secrets.token_hex(8)
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": calls[0].id,
                 "content": f"{tool_output(conv, k, chars)} (nonce {nonce})"}]})


def agent_run(c: anthropic.Anthropic, n_calls: int, *, stream: bool = False,
              convs: list[int] | range | None = None, times: list[float] | None = None) -> int:
    """``n_calls`` calls as conversations of :data:`CONV_TURNS` calls (or only the
    conversations ``convs`` of that run); returns the number of calls made."""
    if n_calls % CONV_TURNS:
        raise ValueError(f"n_calls={n_calls} is not a multiple of {CONV_TURNS}")
    todo = range(n_calls // CONV_TURNS) if convs is None else convs
    for conv in todo:
        conversation(c, conv, CONV_TURNS, stream=stream, times=times)
    return len(todo) * CONV_TURNS


# ---------------------------------------------------------------------------- SDK floor


class Capture:
    """Every exchange of the SDK with the stub, kept in memory: request bodies and whole
    responses (status, headers, body bytes), for the in-process floor and for counting
    unique content."""

    _DROP = frozenset({"content-length", "transfer-encoding", "connection", "content-encoding"})

    def __init__(self, url: str) -> None:
        self.requests: list[bytes] = []
        self.responses: list[tuple[int, list[tuple[str, str]], bytes]] = []
        self.url = url
        self._upstream = httpx2.Client(timeout=60)

    def _handle(self, request: httpx2.Request) -> httpx2.Response:
        body = request.read()
        self.requests.append(body)
        up = self._upstream.send(self._upstream.build_request(
            request.method, str(request.url), headers=request.headers, content=body))
        headers = [(k, v) for k, v in up.headers.items() if k.lower() not in self._DROP]
        self.responses.append((up.status_code, headers, up.content))
        return httpx2.Response(up.status_code, headers=headers, content=up.content)

    def client(self) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.url, api_key=API_KEY,
                                   http_client=httpx2.Client(
                                       transport=httpx2.MockTransport(self._handle)))

    def close(self) -> None:
        self._upstream.close()


def floor_client(answers: list[tuple[int, list[tuple[str, str]], bytes]],
                 base_url: str) -> anthropic.Anthropic:
    """The SDK's own floor: the real client and its whole HTTP path (request building,
    httpx2, response parsing), answered in order from memory by an in-process
    ``httpx2.MockTransport``, no socket, no matching. ``base_url`` is the one the replays
    use: the SDK parses each request's URL, and an IP address costs it more than a name."""
    it = iter(answers)

    def handle(request: httpx2.Request) -> httpx2.Response:
        status, headers, body = next(it)
        return httpx2.Response(status, headers=headers, content=body)

    return anthropic.Anthropic(base_url=base_url, api_key=API_KEY,
                               http_client=httpx2.Client(transport=httpx2.MockTransport(handle)))


# ---------------------------------------------------------------------------- agent-rewind


def rewind_version() -> str | None:
    """agent-rewind's version if it is installed (``make bench`` installs the pinned one)."""
    try:
        import rewind
    except ImportError:
        return None
    return str(rewind.__version__)


@contextlib.contextmanager
def rewind_patched() -> Iterator[Any]:
    """agent-rewind's anthropic patch (class-level ``Messages.create``/``stream``), removed
    on exit; yields the ``rewind`` module (``rewind.record(path)`` / ``rewind.replay(path)``)."""
    import rewind

    unpatch = rewind.patch_anthropic()
    try:
        yield rewind
    finally:
        unpatch()
