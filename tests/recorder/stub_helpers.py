"""What the test_stubserver files share: a model and a request, server and client fixtures,
raw HTTP, and a recorded message.
"""

from __future__ import annotations

import http.client
from collections.abc import Callable, Iterator
from pathlib import Path

import anthropic
import pytest

from recorder.testing.server import StubServer

ROOT = Path(__file__).resolve().parents[2]
# Not a model name the SDK knows (it warns about deprecated ones, and warnings are errors).
MODEL = "claude-stub-test"
USER = [{"role": "user", "content": "hi"}]


def create(client: anthropic.Anthropic, **kwargs: object) -> anthropic.types.Message:
    params: dict = {"model": MODEL, "max_tokens": 64, "messages": USER}
    params.update(kwargs)
    return client.messages.create(**params)


@pytest.fixture
def make_server(stub: Callable[[dict], StubServer]) -> Callable[[dict], StubServer]:
    """The suite's ``stub`` fixture (tests/conftest.py), under the name these tests use."""
    return stub


@pytest.fixture
def make_client() -> Iterator:
    clients: list[anthropic.Anthropic] = []

    def make(server: StubServer, max_retries: int = 0) -> anthropic.Anthropic:
        client = anthropic.Anthropic(
            base_url=server.url, api_key="sk-test", max_retries=max_retries
        )
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


def raw_request(
    server: StubServer, method: str, path: str, body: bytes | None = None
) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    try:
        headers = {"content-type": "application/json"} if body is not None else {}
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


# A message as the API sent it, for the ``message`` and ``sse`` turns.
RECORDED = {
    "id": "msg_recorded_01",
    "type": "message",
    "role": "assistant",
    "model": "claude-recorded",
    "content": [
        {"type": "text", "text": "as recorded, Grüße"},
        {"type": "tool_use", "id": "toolu_recorded_01", "name": "search", "input": {"q": "x"}},
    ],
    "stop_reason": "tool_use",
    "stop_sequence": None,
    "usage": {"input_tokens": 7, "output_tokens": 5},
}
