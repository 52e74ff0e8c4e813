"""The recording proxy under load and under faults: many clients at once, the guards
through the proxy (loop, cancel, budget), bad input, a broken upstream, a client that
leaves mid-stream, secrets, and a shutdown with a stream in flight. Every proxy is a real
``deja proxy`` process; the clients are the real Python and TypeScript SDKs; the upstream
is the stub server."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anthropic
import httpx2
import pytest
from node_helpers import API_ERROR_EXIT, ensure_node_modules, node_agent, read_dump
from proxy_helpers import ProxyProcess, cassettes, run_proxy

from recorder.cassette import load
from recorder.testing.server import StubServer

MODEL = "claude-sonnet-4-6"
API_KEY = "sk-ant-test-SECRET-4f1c9e"

Proxy = Callable[..., ProxyProcess]
Stub = Callable[[dict], StubServer]


# ---------------------------------------------------------------------------- helpers


class _TeeStream(httpx2.SyncByteStream):
    """A response body passed on unchanged, with a copy of every byte kept."""

    def __init__(self, inner: Any, sink: bytearray) -> None:
        self.inner, self.sink = inner, sink

    def __iter__(self) -> Iterator[bytes]:
        for part in self.inner:
            self.sink.extend(part)
            yield part

    def close(self) -> None:
        self.inner.close()


class Wire(httpx2.HTTPTransport):
    """The SDK's real transport, keeping each HTTP attempt and the bytes it received."""

    def __init__(self) -> None:
        super().__init__()
        self.attempts: list[tuple[httpx2.Request, httpx2.Response, bytearray]] = []

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        response = super().handle_request(request)
        sink = bytearray()
        response.stream = _TeeStream(response.stream, sink)
        self.attempts.append((request, response, sink))
        return response


@dataclass
class Agent:
    """A tool-using agent loop on a real anthropic client; ``wire`` sees every attempt."""

    url: str
    prompt: str
    stream: bool = False
    api_key: str = API_KEY
    max_retries: int = 2
    headers: dict[str, str] = field(default_factory=dict)
    result: Callable[[Any, int], str] = lambda block, n: f"{block.name} result {n}"
    messages: list[dict[str, Any]] = field(default_factory=list)
    replies: list[tuple[str, Any, bytes]] = field(default_factory=list)  # run, message, raw
    wire: Wire = field(default_factory=Wire)

    def __post_init__(self) -> None:
        self.messages = [{"role": "user", "content": self.prompt}]
        self._http = httpx2.Client(transport=self.wire, timeout=60)
        self.client = anthropic.Anthropic(base_url=self.url, api_key=self.api_key,
                                          max_retries=self.max_retries,
                                          http_client=self._http)

    def close(self) -> None:
        self.client.close()
        self._http.close()

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def ask(self) -> Any:
        params: dict[str, Any] = {"model": MODEL, "max_tokens": 256,
                                  "messages": self.messages, "extra_headers": self.headers}
        if self.stream:
            with self.client.messages.stream(**params) as s:
                message = s.get_final_message()
                run = s.response.headers["x-deja-run-id"]
        else:
            raw = self.client.messages.with_raw_response.create(**params)
            message, run = raw.parse(), raw.headers["x-deja-run-id"]
        self.replies.append((run, message, bytes(self.wire.attempts[-1][2])))
        n = len(self.replies)
        self.messages = [*self.messages, {"role": "assistant", "content": [
            b.model_dump(mode="json", exclude_none=True) for b in message.content]}]
        uses = [b for b in message.content if b.type == "tool_use"]
        if uses:
            self.messages = [*self.messages, {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": b.id, "content": self.result(b, n)}
                for b in uses]}]
        return message

    def run(self, limit: int = 8) -> None:
        for _ in range(limit):
            if self.ask().stop_reason != "tool_use":
                return

    @property
    def run_ids(self) -> set[str]:
        return {r for r, _, _ in self.replies}


@pytest.fixture
def agents() -> Iterator[Callable[..., Agent]]:
    made: list[Agent] = []

    def make(*args: Any, **kwargs: Any) -> Agent:
        agent = Agent(*args, **kwargs)
        made.append(agent)
        return agent

    yield make
    for agent in made:
        agent.close()


def start(proxy: Proxy, upstream: str, tmp_path: Path, *args: str) -> ProxyProcess:
    return proxy("--upstream", upstream, "--dir", str(tmp_path / "runs"), *args)


def stop(p: ProxyProcess) -> str:
    code, log = p.stop()
    assert code == 0, log
    return log


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def only_cassette(tmp_path: Path) -> Path:
    found = cassettes(tmp_path / "runs")
    assert len(found) == 1, found
    return found[0]


def verified(path: Path) -> Any:
    c = load(path, require_signature=True)
    assert c.verified, c.verify_note
    return c


def model_lines(c: Any) -> list[dict[str, Any]]:
    return [o for o in c.observations if o["kind"] == "model"]


def controls(path: Path) -> list[str]:
    return [line["event"] for line in lines(path)[1:] if line["kind"] == "control"]


def body(text: str = "hi", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 64, "messages": [{"role": "user", "content": text}],
            **extra}


def assert_provider_error(response: httpx2.Response, status: int, kind: str) -> str:
    """An Anthropic-shaped error object with ``status`` and ``kind``; its message."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    data = response.json()
    assert data["type"] == "error" and set(data["error"]) >= {"type", "message"}, data
    assert data["error"]["type"] == kind, data
    assert isinstance(data["error"]["message"], str) and data["error"]["message"]
    return str(data["error"]["message"])


def assert_healthy(p: ProxyProcess) -> dict[str, Any]:
    r = httpx2.get(f"{p.url}/_deja/health", timeout=10)
    assert r.status_code == 200, r.text
    health = r.json()
    assert health["ok"] is True and health["mode"] == "record"
    return dict(health)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(predicate: Callable[[], Any], timeout: float = 10.0, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what or predicate}")


def stop_error_of(exc: anthropic.APIStatusError, reason: str) -> str:
    """The proxy's answer to a request of a stopped run: its message."""
    assert exc.status_code == 400
    assert exc.response.headers.get("x-should-retry") == "false"
    assert exc.response.headers.get("x-deja-stop") == reason
    data = exc.response.json()
    assert data["type"] == "error" and data["error"]["type"] == "invalid_request_error"
    message = str(data["error"]["message"])
    assert "stopped" in message and f"({reason})" in message, message
    return message


def model_posts(log: str, status: int) -> int:
    return sum(1 for line in log.splitlines() if f"POST /v1/messages {status} " in line)


# ----------------------------------------------------------------------- concurrency

CLIENTS = 32
THREE_TURNS = {  # a tool, another tool, then the answer: three model calls per conversation
    "model": MODEL, "select": "conversation",
    "turns": [{"text": "Searching.", "tool_use": {"name": "search", "input": {"q": "x"}}},
              {"text": "Fetching.", "tool_use": {"name": "fetch", "input": {"url": "u"}}},
              {"text": "Answer: {echo}"}]}


def _prompt(i: int) -> str:
    return f"<conversation {i:02d} of the crowd>"


def test_32_clients_at_once_each_get_their_own_whole_run(
        proxy: Proxy, stub: Stub, tmp_path: Path, agents: Callable[..., Agent]) -> None:
    p = start(proxy, stub(THREE_TURNS).url, tmp_path)
    crowd = [agents(p.url, _prompt(i), stream=True,
                    result=lambda b, n, i=i: f"{b.name} result {n} for {_prompt(i)}")
             for i in range(CLIENTS)]
    barrier = threading.Barrier(CLIENTS)
    errors: list[BaseException] = []

    def work(agent: Agent) -> None:
        try:
            barrier.wait(timeout=30)
            agent.run()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(a,)) for a in crowd]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    elapsed = time.perf_counter() - t0
    assert not errors, errors[:3]
    assert all(len(a.replies) == 3 for a in crowd)
    assert all(len(a.wire.attempts) == 3 for a in crowd)  # no retry was needed
    assert_healthy(p)
    stop(p)
    print(f"\n{CLIENTS} clients x 3 streamed turns through one proxy: {elapsed:.2f}s")

    found = cassettes(tmp_path / "runs")
    assert len(found) == CLIENTS
    by_run = {}
    for path in found:
        c = verified(path)
        assert c.end is not None and c.end["status"] == "completed"
        by_run[c.run] = c
    assert sum(len(model_lines(c)) for c in by_run.values()) == CLIENTS * 3  # nothing lost
    assert len({next(iter(a.run_ids)) for a in crowd if len(a.run_ids) == 1}) == CLIENTS
    for i, agent in enumerate(crowd):
        (run,) = agent.run_ids
        c = by_run[run]
        text = c.path.read_text()
        others = [_prompt(j) for j in range(CLIENTS) if j != i]
        assert not [o for o in others if o in text], f"{run} holds another conversation"
        steps = model_lines(c)
        assert [c.request_of(o["seq"])["messages"][0]["content"] for o in steps] == \
            [agent.prompt] * 3
        assert [o["name"] for o in c.observations if o["kind"] == "tool"] == \
            ["search", "fetch"]
        assert [o["result"] for o in c.observations if o["kind"] == "tool"] == \
            [f"search result 1 for {agent.prompt}", f"fetch result 2 for {agent.prompt}"]
        # What the client received is what its cassette holds, byte for byte.
        assert [o["response"]["body"].encode() for o in steps] == \
            [raw for _, _, raw in agent.replies]
        assert [o["message_id"] for o in steps] == [m.id for _, m, _ in agent.replies]
        assert agent.replies[-1][1].content[0].text == \
            f"Answer: fetch result 2 for {agent.prompt}"


# -------------------------------------------------------------- guards through the proxy

LOOP = {"model": MODEL,  # the model asks for the very same call, every turn
        "default": {"text": "Again.", "tool_use": {"name": "look", "input": {"path": "/same"}}}}


def test_the_loop_guard_stops_a_looping_agent_through_the_proxy(
        proxy: Proxy, stub: Stub, tmp_path: Path, agents: Callable[..., Agent]) -> None:
    server = stub(LOOP)
    p = start(proxy, server.url, tmp_path)
    agent = agents(p.url, "look until it changes", max_retries=2,
                   result=lambda b, n: "unchanged")
    for _ in range(3):  # the first call, then two identical tool results
        agent.ask()
    assert len(server.received()) == 3
    before = len(agent.wire.attempts)
    with pytest.raises(anthropic.BadRequestError) as err:
        agent.ask()  # the third identical result
    assert len(agent.wire.attempts) - before == 1  # one HTTP attempt, never retried
    message = stop_error_of(err.value, "loop_detected")
    assert "fork" in message
    assert len(server.received()) == 3  # the refused request never went upstream
    (run,) = agent.run_ids
    assert err.value.response.headers["x-deja-run-id"] == run
    path = only_cassette(tmp_path)
    assert path.name == f"{run}.jsonl"
    end = lines(path)[-1]
    assert end["kind"] == "end" and end["status"] == "stopped"
    assert controls(path) == ["loop_detected"]
    assert [line["name"] for line in lines(path)[1:] if line["kind"] == "tool"] == \
        ["look"] * 3

    # The agent tries again, and again with more history: the same answer, no new run.
    for extra in ([], [{"role": "assistant", "content": "retrying"},
                       {"role": "user", "content": "please go on"}]):
        agent.messages = [*agent.messages, *extra]
        before = len(agent.wire.attempts)
        with pytest.raises(anthropic.BadRequestError) as again:
            agent.ask()
        assert len(agent.wire.attempts) - before == 1
        stop_error_of(again.value, "loop_detected")
        assert again.value.response.headers["x-deja-run-id"] == run
    assert len(server.received()) == 3
    assert cassettes(tmp_path / "runs") == [path]
    log = stop(p)
    assert model_posts(log, 400) == 3
    assert lines(path)[-1]["status"] == "stopped"
    verified(path)


def test_the_loop_guard_stops_the_typescript_sdk_too(proxy: Proxy, stub: Stub,
                                                     tmp_path: Path) -> None:
    ensure_node_modules()
    server = stub({"model": MODEL, "default": {
        "text": "Checking again.", "tool_use": {"name": "get_weather",
                                                "input": {"city": "Paris"}}}})
    p = start(proxy, server.url, tmp_path)
    dump = tmp_path / "dump.jsonl"
    done = node_agent("--dump", str(dump), env={"ANTHROPIC_BASE_URL": p.url})
    assert done.returncode == API_ERROR_EXIT, (done.stdout, done.stderr)
    assert "error: 400" in done.stderr and "loop_detected" in done.stderr, done.stderr
    assert "attempts: 1" in done.stderr, done.stderr
    attempts = read_dump(dump)
    assert [a["status"] for a in attempts] == [200, 200, 200, 400]
    assert [a["retry_count"] for a in attempts] == [0, 0, 0, 0]
    assert len(server.received()) == 3
    path = only_cassette(tmp_path)
    assert lines(path)[-1]["status"] == "stopped"
    assert controls(path) == ["loop_detected"]
    stop(p)
    verified(path)


def test_deja_cancel_stops_a_proxied_run(proxy: Proxy, stub: Stub, tmp_path: Path,
                                          agents: Callable[..., Agent]) -> None:
    server = stub({"model": MODEL, "select": "conversation", "turns": THREE_TURNS["turns"]})
    p = start(proxy, server.url, tmp_path)
    agent = agents(p.url, "cancel me", stream=True)
    agent.ask()
    (run,) = agent.run_ids
    cancel = subprocess.run([sys.executable, "-m", "deja", "cancel", run,
                             "--reason", "test says stop"], capture_output=True, text=True,
                            timeout=60, cwd=tmp_path)
    assert cancel.returncode == 0, cancel.stderr
    before = len(agent.wire.attempts)
    with pytest.raises(anthropic.BadRequestError) as err:
        agent.ask()
    assert len(agent.wire.attempts) - before == 1
    message = stop_error_of(err.value, "cancelled")
    assert "deja cancel" in message
    assert len(server.received()) == 1
    path = tmp_path / "runs" / f"{run}.jsonl"
    end = lines(path)[-1]
    assert end["kind"] == "end" and end["status"] == "cancelled"
    assert controls(path) == ["cancelled"]
    stop(p)
    assert cassettes(tmp_path / "runs") == [path]
    verified(path)


def test_a_turn_budget_stops_a_proxied_run(proxy: Proxy, stub: Stub, tmp_path: Path,
                                            agents: Callable[..., Agent]) -> None:
    server = stub(THREE_TURNS)
    p = start(proxy, server.url, tmp_path, "--max-turns", "2")
    agent = agents(p.url, "three turns, two allowed")
    agent.ask()
    agent.ask()
    before = len(agent.wire.attempts)
    with pytest.raises(anthropic.BadRequestError) as err:
        agent.ask()
    assert len(agent.wire.attempts) - before == 1
    stop_error_of(err.value, "turns_budget")
    assert len(server.received()) == 2
    path = only_cassette(tmp_path)
    assert lines(path)[-1]["status"] == "exhausted"
    assert controls(path) == ["budget_exhausted"]
    assert len(model_lines(verified(path))) == 2
    stop(p)


# ---------------------------------------------------------------------------- bad input


def test_bad_requests_get_provider_errors_and_the_proxy_goes_on(
        proxy: Proxy, stub: Stub, tmp_path: Path) -> None:
    server = stub({"model": MODEL, "default": {"text": "fine"}})
    p = start(proxy, server.url, tmp_path, "--max-body", "1000")
    with httpx2.Client(base_url=p.url, timeout=30,
                       headers={"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}) as hc:
        # A malformed JSON body: refused, nothing forwarded.
        for bad in (b'{"model": "m", "messages": [', b"[1, 2]", b""):
            r = hc.post("/v1/messages", content=bad,
                        headers={"content-type": "application/json"})
            message = assert_provider_error(r, 400, "invalid_request_error")
            assert "Nothing was sent upstream" in message
            assert r.headers.get("x-should-retry") == "false"
        assert server.received() == []
        assert_healthy(p)
        # An unknown API path is forwarded; the upstream's own 404 comes back.
        r = hc.post("/v1/nonsense", json={"x": 1})
        message = assert_provider_error(r, 404, "not_found_error")
        assert message == "Not found: POST /v1/nonsense"
        assert r.headers["request-id"].startswith("req_")  # the stub's answer
        # An unknown path of the proxy's own: its 404.
        r = hc.get("/_deja/nope")
        message = assert_provider_error(r, 404, "not_found_error")
        assert "/_deja/nope" in message
        # A body over --max-body: 413, with a length given or sent chunked.
        big = json.dumps(body("x" * 2000)).encode()
        r = hc.post("/v1/messages", content=big, headers={"content-type": "application/json"})
        assert "--max-body" in assert_provider_error(r, 413, "request_too_large")

        def chunks() -> Iterator[bytes]:
            for i in range(0, len(big), 100):
                yield big[i:i + 100]

        r = hc.post("/v1/messages", content=chunks(),
                    headers={"content-type": "application/json"})
        assert_provider_error(r, 413, "request_too_large")
        assert server.received() == []
        # And the proxy still serves, health and model calls alike.
        assert_healthy(p)
        r = hc.post("/v1/messages", json=body())
        assert r.status_code == 200 and r.json()["content"][0]["text"] == "fine"
        assert len(server.received()) == 1
    stop(p)


def test_a_request_nested_deeper_than_a_cassette_holds_is_refused_and_never_sent(
        proxy: Proxy, stub: Stub, tmp_path: Path) -> None:
    """190 levels is recorded (and the cassette loads); 191 is a 400, as NaN would be."""
    server = stub({"model": MODEL, "default": {"text": "fine"}})
    p = start(proxy, server.url, tmp_path)

    def nested(levels: int) -> bytes:  # the body, its metadata, then ``levels - 2`` lists
        lists = json.loads("[" * (levels - 2) + "]" * (levels - 2))
        return json.dumps(body(metadata={"x": lists}), separators=(",", ":")).encode()

    with httpx2.Client(base_url=p.url, timeout=30,
                       headers={"x-api-key": API_KEY, "anthropic-version": "2023-06-01",
                                "content-type": "application/json"}) as hc:
        r = hc.post("/v1/messages", content=nested(191))
        message = assert_provider_error(r, 400, "invalid_request_error")
        assert "nested too deeply for a cassette line (more than 190 levels" in message
        assert server.received() == []
        r = hc.post("/v1/messages", content=nested(190))
        assert r.status_code == 200 and r.json()["content"][0]["text"] == "fine"
        assert len(server.received()) == 1
    stop(p)
    assert len(model_lines(verified(only_cassette(tmp_path)))) == 1  # and it loads


def test_the_proxy_token(proxy: Proxy, stub: Stub, tmp_path: Path) -> None:
    server = stub({"model": MODEL, "default": {"text": "fine"}})
    p = start(proxy, server.url, tmp_path, "--token", "sekrit")
    with httpx2.Client(base_url=p.url, timeout=30,
                       headers={"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}) as hc:
        for headers in ({}, {"x-deja-token": "wrong"}, {"x-deja-token": "sekri"},
                        {"x-deja-token": "sekrit2"}):
            r = hc.post("/v1/messages", json=body(), headers=headers)
            assert "x-deja-token" in assert_provider_error(r, 401, "authentication_error")
            r = hc.get("/_deja/nope", headers=headers)  # no probing the proxy either
            assert_provider_error(r, 401, "authentication_error")
        assert server.received() == []
        assert_healthy(p)
        r = hc.post("/v1/messages", json=body(), headers={"x-deja-token": "sekrit"})
        assert r.status_code == 200, r.text
    (sent,) = server.received()
    assert "x-deja-token" not in sent["headers"]  # the token stays at the proxy
    stop(p)


def test_a_non_loopback_host_needs_a_token(tmp_path: Path) -> None:
    done = run_proxy(tmp_path, "--host", "0.0.0.0", "--port", "0", "--dir", str(tmp_path))
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "--token" in done.stderr and "0.0.0.0" in done.stderr
    assert cassettes(tmp_path) == []


def test_an_unreachable_upstream_is_a_502_and_a_logged_error(
        proxy: Proxy, tmp_path: Path) -> None:
    port = closed_port()
    p = start(proxy, f"http://127.0.0.1:{port}", tmp_path)
    with httpx2.Client(base_url=p.url, timeout=30,
                       headers={"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}) as hc:
        r = hc.post("/v1/messages", json=body("anyone there?"))
        message = assert_provider_error(r, 502, "api_error")
        assert f"127.0.0.1:{port}" in message and "could not be reached" in message
        assert r.headers.get("x-should-retry") != "false"  # the SDKs may retry it
        run = r.headers["x-deja-run-id"]
        assert_healthy(p)
    # The SDK retries it, as a connection error, and then raises.
    with Agent(p.url, "anyone there?", max_retries=1) as agent:
        with pytest.raises(anthropic.InternalServerError):
            agent.ask()
        assert len(agent.wire.attempts) == 2
        retried = {resp.headers["x-deja-run-id"] for _, resp, _ in agent.wire.attempts}
    assert len(retried) == 1  # the retry is in the run of the attempt it repeats
    log = stop(p)
    path = tmp_path / "runs" / f"{run}.jsonl"
    c = verified(path)
    (first, *_) = model_lines(c)
    assert "response" not in first
    assert first["error"]["has_response"] is False
    assert "Connect" in first["error"]["type"], first["error"]
    assert c.end is not None and c.end["status"] == "error"
    assert model_posts(log, 502) == 3


def test_an_upstream_529_passes_through_and_is_recorded(
        proxy: Proxy, stub: Stub, tmp_path: Path, agents: Callable[..., Agent]) -> None:
    server = stub({"model": MODEL, "turns": [{"error": {
        "status": 529, "type": "overloaded_error", "message": "stub overloaded, on purpose",
        "should_retry": False}}]})
    p = start(proxy, server.url, tmp_path)
    agent = agents(p.url, "busy?", max_retries=2)
    with pytest.raises(anthropic.OverloadedError) as err:
        agent.ask()
    assert len(agent.wire.attempts) == 1  # its x-should-retry: false came through
    response = err.value.response
    assert response.status_code == 529
    assert response.headers["x-should-retry"] == "false"
    received = response.json()
    assert received["error"] == {"type": "overloaded_error",
                                 "message": "stub overloaded, on purpose"}
    assert received["request_id"] == response.headers["request-id"]  # the stub's own body
    assert len(server.received()) == 1
    assert_healthy(p)
    stop(p)
    (step,) = model_lines(verified(only_cassette(tmp_path)))
    assert step["response"]["status"] == 529
    assert json.loads(step["response"]["body"]) == received
    assert step["api_error"]["type"] == "overloaded_error"


def test_a_client_that_leaves_mid_stream(proxy: Proxy, stub: Stub, tmp_path: Path) -> None:
    server = stub({"model": MODEL, "rules": [
        {"when": {"first_user": "slow"}, "text": "one two three four five six seven eight",
         "event_delay_ms": 150}], "default": {"text": "quick"}})
    p = start(proxy, server.url, tmp_path)
    headers = {"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}
    with httpx2.Client(base_url=p.url, timeout=30, headers=headers) as hc:
        with hc.stream("POST", "/v1/messages", json=body("slow", stream=True)) as r:
            assert r.status_code == 200
            run = r.headers["x-deja-run-id"]
            first = next(r.iter_raw())
            assert first.startswith(b"event: message_start")
        # The connection is closed here, with most of the stream still to come.
        assert_healthy(p)
        r = hc.post("/v1/messages", json=body("meanwhile"))
        assert r.status_code == 200 and r.json()["content"][0]["text"] == "quick"
        wait_for(lambda: "disconnected" in p.log(), what="the proxy to see the client go")
        assert_healthy(p)
    log = stop(p)
    c = verified(tmp_path / "runs" / f"{run}.jsonl")
    (step,) = model_lines(c)
    assert step["error"]["has_response"] is True
    assert "disconnected" in step["error"]["message"]
    assert step["response"]["body"].startswith("event: message_start")
    assert "message_stop" not in step["response"]["body"]
    assert c.end is not None
    assert "Traceback" not in log


# ------------------------------------------------------------------------------ secrets


def test_no_secret_reaches_the_disk(proxy: Proxy, stub: Stub, tmp_path: Path,
                                    deja_home: Path) -> None:
    api_key = "sk-ant-api03-" + "Q7xWv2Lm9PzR4tYb8NcE1kHdJ6sUgA3fXo5iVqBn0TyZ" + "-AA"
    bearer = "sk-ant-oat01-" + "M3nB7vC1xZ9qW5eR2tY8uI4oP6aS0dF3gH7jK1lL5mN9" + "-BB"
    in_result = "sk-ant-api03-" + "H4sJ8kL2mN6pQ0rT3vW7yZ1bC5dF9gX2nM4qR8tV6wY0" + "-CC"
    token = "deja-proxy-token-5c8e1f0a9b3d"
    server = stub({"model": MODEL, "select": "conversation", "turns": [
        {"text": "Reading the env.", "tool_use": {"name": "read_env", "input": {}}},
        {"text": "You said: {echo}"}]})
    p = start(proxy, server.url, tmp_path, "--token", token)
    headers = {"x-api-key": api_key, "authorization": f"Bearer {bearer}",
               "x-deja-token": token, "anthropic-version": "2023-06-01"}
    with httpx2.Client(base_url=p.url, timeout=30, headers=headers) as hc:
        r = hc.post("/v1/messages", json=body("show me the env"))
        assert r.status_code == 200, r.text
        reply = r.json()
        use = reply["content"][1]
        follow = body("show me the env", stream=True)
        follow["messages"] += [
            {"role": "assistant", "content": reply["content"]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"],
                                          "content": f"ANTHROPIC_API_KEY={in_result}"}]}]
        r = hc.post("/v1/messages", json=follow)
        assert r.status_code == 200 and in_result in r.text  # the model echoed it back
    sent = server.received()
    assert sent[0]["headers"]["x-api-key"] == api_key  # the keys did go upstream
    assert sent[0]["headers"]["authorization"] == f"Bearer {bearer}"
    stop(p)
    listed = subprocess.run([sys.executable, "-m", "deja", "ls", str(tmp_path / "runs")],
                            capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr  # its index is written too
    path = only_cassette(tmp_path)
    assert len(model_lines(verified(path))) == 2
    files = [f for root in (tmp_path / "runs", deja_home) for f in root.rglob("*")
             if f.is_file()]
    assert any(f.parent.name == "runs" and f.parent.parent == deja_home for f in files)
    for f in files:
        data = f.read_bytes()
        for secret in (api_key, bearer, in_result, token):
            assert secret.encode() not in data, f"{secret[:16]}... written to {f}"


# ----------------------------------------------------------------------------- shutdown


def test_sigterm_lets_a_stream_in_flight_finish(proxy: Proxy, stub: Stub, tmp_path: Path,
                                                agents: Callable[..., Agent]) -> None:
    text = "one two three four five six seven eight"
    server = stub({"model": MODEL, "default": {"text": text, "event_delay_ms": 125}})
    p = start(proxy, server.url, tmp_path, "--grace", "5")
    agent = agents(p.url, "take your time", stream=True, max_retries=0)
    outcome: list[Any] = []

    def client() -> None:
        try:
            outcome.append(agent.ask())
        except BaseException as exc:  # noqa: BLE001 - checked below
            outcome.append(exc)

    thread = threading.Thread(target=client)
    thread.start()
    wait_for(lambda: agent.wire.attempts and agent.wire.attempts[-1][2], what="the first bytes")
    t0 = time.monotonic()
    p.process.send_signal(signal.SIGTERM)
    thread.join(timeout=20)
    code = p.process.wait(timeout=20)
    took = time.monotonic() - t0
    (message,) = outcome
    assert not isinstance(message, BaseException), message
    assert message.content[0].text == text and message.stop_reason == "end_turn"
    assert code == 0, p.log()
    assert took < 5, took
    c = verified(only_cassette(tmp_path))
    (step,) = model_lines(c)
    assert step["response"]["body"].encode() == agent.replies[0][2]
    assert "message_stop" in step["response"]["body"] and "error" not in step
    assert c.end is not None and c.end["status"] == "completed"

