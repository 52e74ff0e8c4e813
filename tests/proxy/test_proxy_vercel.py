"""``deja proxy`` with the Vercel AI SDK, and the Messages API asked for without ``/v1``.

``@ai-sdk/anthropic`` takes a base URL that ends in ``/v1`` (its default is
``https://api.anthropic.com/v1``) and posts to ``BASE/messages``; given the proxy's bare URL
in ``ANTHROPIC_BASE_URL``, as ``deja replay -- CMD`` gives it, it posts to ``/messages``. The
proxy takes that as ``/v1/messages``: forwarded there, recorded as a model step exactly as
the official SDKs' call is, and served from a recording whichever of the two paths asks.
The agent (examples/vercel-agent) runs the SDK's own tool loop against the stub model,
through a real proxy, then offline through ``deja replay``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from node_helpers import (
    STUB_ANSWER,
    STUB_SCRIPT,
    VERCEL_AGENT,
    VERCEL_DIR,
    agent_env,
    ensure_node_modules,
    node_agent,
    node_missing,
)
from proxy_helpers import ProxyProcess, cassettes, lines, load_verified

from recorder.testing.server import StubServer

MODEL = "claude-sonnet-4-6"
Proxy = Callable[..., ProxyProcess]
Stub = Callable[[dict], StubServer]


@pytest.fixture(scope="module", autouse=True)
def _node_modules() -> None:
    assert node_missing() is None, node_missing()
    ensure_node_modules(VERCEL_DIR)


def post(url: str, body: dict[str, Any]) -> tuple[int, bytes]:
    """POST ``body`` as JSON to ``url`` as an SDK would; the status and the body's bytes."""
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="POST",
        headers={"content-type": "application/json", "x-api-key": "sk-test",
                 "anthropic-version": "2023-06-01"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


@pytest.mark.parametrize("mode", ["stream", "json"])
def test_vercel_ai_sdk_agent_records_model_steps_and_replays_identically(
        proxy: Proxy, stub: Stub, tmp_path: Path, mode: str) -> None:
    flags = ("--json",) if mode == "json" else ()
    upstream = stub(json.loads(STUB_SCRIPT.read_text(encoding="utf-8")))
    model_url = f"{upstream.url}/v1/messages"
    directory = tmp_path / "recorded"
    recording = proxy("--upstream", upstream.url, "--dir", str(directory))
    run = node_agent(*flags, agent=VERCEL_AGENT, env={"ANTHROPIC_BASE_URL": recording.url})
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == STUB_ANSWER
    status, log = recording.stop()
    assert status == 0, log
    assert "POST /v1/messages 200" in log, log
    upstream.stop()
    assert [r["path"] for r in upstream.requests] == ["/v1/messages"] * 3

    # model steps and the tool results the proxy saw, not a 404 of /messages
    [cassette_path] = cassettes(directory)
    cassette = load_verified(cassette_path)
    assert cassette.end is not None and cassette.end["status"] == "completed"
    steps = lines(cassette)
    assert [o["kind"] for o in steps] == ["model", "tool", "model", "tool", "model"]
    assert [(o["name"], o["result"], o["observed"]) for o in steps if o["kind"] == "tool"] == [
        ("get_weather", "Paris: 18°C, light rain", "proxy"),
        ("convert", "18°C is 64.4°F", "proxy")]
    for o in steps:
        if o["kind"] == "model":
            assert o["url"] == model_url, o["url"]
            assert o["response"]["status"] == 200
    for seq in (0, 2, 4):
        body = cassette.request_of(seq)
        assert body["model"] == MODEL
        assert (body.get("stream") is True) == (mode == "stream")

    # deja replay -- node agent.mjs: the proxy it starts serves the recording offline
    replay = subprocess.run(
        [sys.executable, "-m", "deja", "replay", str(cassette_path), "--", "node",
         str(VERCEL_AGENT), *flags], cwd=VERCEL_DIR, env=agent_env(),
        capture_output=True, text=True, timeout=120)
    assert replay.returncode == 0, replay.stderr
    assert replay.stdout.splitlines()[0] == STUB_ANSWER
    # the report of deja replay, on stdout after the agent's own output
    assert ": identical" in replay.stdout and "steps:      5/5 served" in replay.stdout, \
        replay.stdout
    assert "replayed:   exit status 0" in replay.stdout, replay.stdout
    assert len(upstream.requests) == 3  # nothing went to the model


@pytest.mark.parametrize("base", ["", "/v1"])
def test_messages_without_v1_is_the_messages_endpoint_recorded_and_replayed(
        proxy: Proxy, stub: Stub, tmp_path: Path, base: str) -> None:
    """``/messages`` is recorded as ``/v1/messages`` (an upstream whose URL already ends in
    ``/v1`` gets it once), and its recording serves either path byte for byte."""
    upstream = stub({"select": "conversation", "turns": [{"text": "Bonjour !"}]})
    body = {"model": MODEL, "max_tokens": 64,
            "messages": [{"role": "user", "content": "Say hello in French."}]}
    model_url = f"{upstream.url}/v1/messages"
    directory = tmp_path / "recorded"
    recording = proxy("--upstream", upstream.url + base, "--dir", str(directory))
    status, recorded = post(f"{recording.url}/messages", body)
    assert status == 200, recorded
    assert json.loads(recorded)["content"] == [{"type": "text", "text": "Bonjour !"}]
    stopped, log = recording.stop()
    assert stopped == 0, log
    upstream.stop()
    assert [r["path"] for r in upstream.requests] == ["/v1/messages"]
    [cassette_path] = cassettes(directory)
    [step] = lines(load_verified(cassette_path))
    assert step["kind"] == "model"
    assert step["url"] == model_url

    for path in ("/v1/messages", "/messages"):
        replaying = proxy("--replay", str(cassette_path))
        assert post(replaying.url + path, body) == (200, recorded), path
        stopped, log = replaying.stop()
        assert stopped == 0, log
        assert ": identical" in log, log
