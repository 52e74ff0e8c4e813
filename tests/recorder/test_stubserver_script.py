"""The stub server's script format (what :func:`load_script` refuses, and where it names
the fault) and its lifecycle.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import anthropic
import httpx2
import pytest
import stub_helpers
from stub_helpers import MODEL, RECORDED, create

from recorder.testing.server import StubScriptError, StubServer, load_script

# Fixtures shared by the test_stubserver files.
make_client = stub_helpers.make_client
make_server = stub_helpers.make_server


# --------------------------------------------------------------------------------------------
# Script validation
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("script", "needles"),
    [
        ({"turns": [{"text": "ok"}, {"text": 5}]}, ["turn 1", "text"]),
        ({"turns": [{"text": "ok"}, {}, {"tool_use": {"input": {}}}]}, ["turn 2", "tool_use.name"]),
        (
            {"turns": [{"tool_use": [{"name": "a"}, {"name": "b", "input": []}]}]},
            ["turn 0", "tool_use[1].input"],
        ),
        ({"turns": [{"error": {"status": 200}}]}, ["turn 0", "error.status"]),
        ({"turns": [{"text": "a"}, {"drop": "never"}]}, ["turn 1", "drop"]),
        ({"turns": [{"delay_ms": -1}]}, ["turn 0", "delay_ms"]),
        ({"turns": [{"usage": {"input_tokens": "many"}}]}, ["turn 0", "usage.input_tokens"]),
        ({"turns": [{"txt": "typo"}]}, ["turn 0", "txt"]),
        (
            {"turns": [{"error": {"status": 500}, "drop": "before_headers"}]},
            ["turn 0", "error", "drop"],
        ),
        ({"turns": [{"sse_error": {"after_events": -2}}]}, ["turn 0", "sse_error.after_events"]),
        ({"turns": "nope"}, ["turns"]),
        ({"turns": [], "default": {"text": 1}}, ["default", "text"]),
        ({"turns": [], "extra": 1}, ["extra"]),
        ({"select": "random", "turns": []}, ["select", "'random'", "conversation"]),
        ({"select": None}, ["select", "None"]),
        ({"turns": [{"drop": "after_headers", "then": []}]}, ["turn 0", "then", "conversation"]),
        (
            {"select": "conversation", "turns": [{"text": "a", "then": [{"text": "b"}]}]},
            ["turn 0", "then", "error"],
        ),
        (
            {"select": "conversation", "turns": [{"drop": "before_headers", "then": {}}]},
            ["turn 0", "then", "list"],
        ),
        (
            {
                "select": "conversation",
                "turns": [{"text": "a"}, {"error": {"status": 529}, "then": [{"text": 1}]}],
            },
            ["turn 1: then[0]", "text"],
        ),
        (
            {
                "select": "conversation",
                "turns": [{"drop": "before_headers", "then": [{"drop": "x", "then": []}]}],
            },
            ["turn 0: then[0]", "drop"],
        ),
        (
            {
                "select": "conversation",
                "turns": [
                    {"drop": "before_headers", "then": [{"drop": "after_headers", "then": []}]}
                ],
            },
            ["turn 0: then[0]", "nested"],
        ),
        (
            {"select": "conversation", "default": {"drop": "before_headers", "then": []}},
            ["default", "then"],
        ),
        ({"rules": {}}, ["rules", "list"]),
        ({"rules": [{"text": "no when"}]}, ["rule 0", "when"]),
        ({"rules": [{"when": {"positon": 1}, "text": "a"}]}, ["rule 0", "positon"]),
        ({"rules": [{"when": {"position": -1}}]}, ["rule 0", "when.position"]),
        ({"rules": [{"when": {"tool_result_is_error": "no"}}]}, ["rule 0", "is_error"]),
        ({"rules": [{"when": {"first_user": 3}}]}, ["rule 0", "when.first_user"]),
        ({"rules": [{"when": {"endpoint": "/v1/x"}}]}, ["rule 0", "when.endpoint",
                                                          "/v1/responses"]),
        ({"rules": [{"when": {"stream": "yes"}}]}, ["rule 0", "when.stream"]),
        ({"rules": [{"when": {"previous_response_id": 1}}]},
         ["rule 0", "when.previous_response_id"]),
        ({"turns": [{"message": {"choices": "x"}}]}, ["turn 0", "message", "choices"]),
        ({"rules": [{"when": {}, "text": "a", "then": [{"text": "b"}]}]}, ["rule 0", "then"]),
        (
            {"rules": [{"when": {}}, {"when": {}, "drop": "before_headers",
                                      "then": [{"when": {}, "text": "b"}]}]},
            ["rule 1: then[0]", "when"],
        ),
        ({"turns": [{"when": {}, "text": "a"}]}, ["turn 0", "when"]),
        ({"turns": [{"message": {"content": "x"}}]}, ["turn 0", "message", "content"]),
        ({"turns": [{"message": {"content": [{"text": "x"}]}}]}, ["turn 0", "content[0]"]),
        ({"turns": [{"message": RECORDED, "text": "x"}]}, ["turn 0", "'message'", "'text'"]),
        ({"turns": [{"sse": "no stream"}]}, ["turn 0", "sse"]),
        ({"turns": [{"sse": "event: a\n\n", "sse_error": {}}]}, ["turn 0", "sse_error"]),
        ({"turns": [{"sse": "event: a\n\n", "message": RECORDED}]}, ["turn 0", "combined"]),
        (
            {"turns": [{"error": {"status": 529, "headers": {"content-length": "1"}}}]},
            ["turn 0", "content-length"],
        ),
        (
            {"turns": [{"error": {"status": 529, "headers": {"bad name": "1"}}}]},
            ["turn 0", "bad name"],
        ),
        (
            {"turns": [{"error": {"status": 529, "headers": {"retry-after": 1}}}]},
            ["turn 0", "retry-after"],
        ),
        (
            {"turns": [{"error": {"status": 529, "headers": {"x-a": "1\r\nx-b: 2"}}}]},
            ["turn 0", "x-a"],
        ),
    ],
)
def test_load_script_errors_name_the_turn(script: dict, needles: list[str]) -> None:
    with pytest.raises(StubScriptError) as info:
        load_script(script)
    assert isinstance(info.value, ValueError)
    for needle in needles:
        assert needle in str(info.value)


def test_load_script_from_file_and_text(tmp_path: Path) -> None:
    script = {"model": MODEL, "turns": [{"text": "from file"}], "_note": "ignored"}
    path = tmp_path / "script.json"
    path.write_text(json.dumps(script))
    assert load_script(path)["turns"] == [{"text": "from file"}]
    assert load_script(str(path))["model"] == MODEL
    assert load_script(json.dumps(script))["turns"][0]["text"] == "from file"
    assert load_script({"default": {"text": "x"}})["turns"] == []
    with pytest.raises(StubScriptError, match="cannot read"):
        load_script(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{oops")
    with pytest.raises(StubScriptError, match="invalid JSON"):
        load_script(bad)
    with pytest.raises(StubScriptError):
        StubServer({"turns": [{"drop": 1}]})
    loaded = load_script({"select": "conversation", "turns": [{"drop": "after_headers"}]})
    assert loaded["select"] == "conversation" and "select" not in load_script(script)


def test_select_validated_over_http(make_server, make_client) -> None:
    server = make_server({"turns": [{"text": "one"}]})
    with httpx2.Client(base_url=server.url) as http:
        bad = http.post("/_stub/script", json={"select": "sticky", "turns": []})
        assert bad.status_code == 400
        assert "'select'" in bad.json()["error"]["message"]
        good = http.post("/_stub/script", json={"select": "conversation", "turns": [{"text": "c"}]})
        assert good.status_code == 200
    client = make_client(server)
    assert [create(client).content[0].text for _ in range(2)] == ["c", "c"]


# --------------------------------------------------------------------------------------------
# Lifecycle
# --------------------------------------------------------------------------------------------


def test_stop_closes_everything() -> None:
    server = StubServer({"default": {"text": "ok"}}).start()
    port = server.port
    assert server.url == f"http://127.0.0.1:{port}"
    with anthropic.Anthropic(base_url=server.url, api_key="sk-test", max_retries=0) as client:
        assert create(client).content[0].text == "ok"  # leaves a keep-alive connection open
        # A second keep-alive connection, idle after one request.
        idle = socket.create_connection(("127.0.0.1", port), timeout=5)
        idle.sendall(b"GET /_stub/health HTTP/1.1\r\nHost: x\r\n\r\n")
        response = b""
        while not response.endswith(b'"served":1}'):
            response += idle.recv(4096)
        server.stop()
        server.stop()  # idempotent
        assert idle.recv(1) == b""  # closed by the server
        idle.close()
        with pytest.raises(anthropic.APIConnectionError):
            create(client)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
