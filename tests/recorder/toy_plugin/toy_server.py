"""The toy model API (see ``toy_deja.py``) as a server on 127.0.0.1, and an agent using it.

Both are written against the wire format alone, knowing nothing of the provider module:
the server is what the plugin is recorded against, and the agent (:func:`toy_loop`) is
the program deja records, replays and forks, calling a tool between model calls (marked
with ``@recorder.tool``, so that an in-process recording has tool steps too).

The server answers by the place in the conversation: no tool result yet, it asks for
``lookup`` of the question's last word; one, for ``lookup`` of ``"again"``; two or more,
it says what the results were and finishes. Ids (of answers and tool calls) and
``served_at`` are fresh in every answer, as a real API's are.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

import recorder

ENDPOINT = "/toy/v1/generate"
MODEL = "toy-1"
KEY = "toy-key-SECRET-5e1d"
RULES = "Answer in one line."
QUESTION = "Look up deja"


def answer(body: dict[str, Any]) -> dict[str, Any]:
    """The toy model's answer to request ``body`` (see the module docstring)."""
    turns = body["turns"]
    outputs = [t["output"] for t in turns if t.get("kind") == "result"]
    word = str(turns[0].get("text", "")).split()[-1] if not outputs else "again"
    if len(outputs) < 2:
        said = [{"kind": "say", "text": f"Looking up {word}."},
                {"kind": "call", "id": f"call_{uuid.uuid4().hex[:10]}", "tool": "lookup",
                 "args": {"word": word}}]
    else:
        said = [{"kind": "say", "text": "Found: " + "; ".join(map(str, outputs))}]
    return {"id": f"gen_{uuid.uuid4().hex[:12]}", "model": body.get("model"), "turns": said,
            "finish": "call" if len(outputs) < 2 else "done",
            "tokens": {"in": 10 * len(turns), "out": 5 + len(outputs), "cached": 4},
            "served_at": time.time()}


def events(message: dict[str, Any]) -> list[dict[str, Any]]:
    """The NDJSON events that stream ``message``: its text in two pieces."""
    tokens = message["tokens"]
    out: list[dict[str, Any]] = [{"event": "begin", "id": message["id"],
                                  "model": message["model"],
                                  "tokens": {"in": tokens["in"], "cached": tokens["cached"]}}]
    for turn in message["turns"]:
        if turn["kind"] == "say":
            half = len(turn["text"]) // 2
            out += [{"event": "text", "piece": turn["text"][:half]},
                    {"event": "text", "piece": turn["text"][half:]}]
        else:
            out.append({"event": "call", "id": turn["id"], "tool": turn["tool"],
                        "args": turn["args"]})
    out.append({"event": "finish", "finish": message["finish"],
                "tokens": {"out": tokens["out"]}})
    return out


class ToyServer:
    """The toy API on a free port of 127.0.0.1; ``requests`` holds every body received
    (and ``headers`` their headers), in order."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                return None

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                server.requests.append(body)
                server.headers.append({k.lower(): v for k, v in self.headers.items()})
                if self.path != ENDPOINT:
                    self._send(404, "application/json",
                               b'{"code": "not_found", "detail": "no such endpoint"}')
                    return
                message = answer(body)
                if not body.get("stream"):
                    self._send(200, "application/json", json.dumps(message).encode())
                    return
                self.send_response(200)  # streamed: each event sent as it is made
                self.send_header("content-type", "application/x-ndjson")
                self.end_headers()
                for event in events(message):
                    self.wfile.write(json.dumps(event).encode() + b"\n")
                    self.wfile.flush()

            def _send(self, status: int, ctype: str, data: bytes) -> None:
                self.send_response(status)
                self.send_header("content-type", ctype)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Stop listening: a request after this finds nothing there."""
        if self.thread.is_alive():
            self.httpd.shutdown()
            self.httpd.server_close()
            self.thread.join()


# ---------------------------------------------------------------------- the agent


@recorder.tool
def lookup(word: str) -> str:
    """The agent's tool (recorded as a tool step when a recording is active)."""
    return f"{word}: French for 'already'"


def _reply_turns(raw: bytes, streamed: bool) -> list[dict[str, Any]]:
    """The turns an answer adds to the conversation, read as a client of the API does."""
    if not streamed:
        return list(json.loads(raw)["turns"])
    got = [json.loads(line) for line in raw.splitlines()]
    text = "".join(e["piece"] for e in got if e["event"] == "text")
    return ([{"kind": "say", "text": text}] if text else []) + [
        {"kind": "call", "id": e["id"], "tool": e["tool"], "args": e["args"]}
        for e in got if e["event"] == "call"]


def toy_loop(url: str, question: str = QUESTION,
             streams: Sequence[bool] = (False, True, False),
             tool: Callable[..., str] = lookup) -> list[bytes]:
    """Ask ``question`` at ``url`` (the API's base URL), run each tool call the answer
    asks for, and ask again with the results, once per entry of ``streams`` (whether that
    call asks for a stream) or until an answer asks for no tool. Every request carries a
    fresh ``nonce`` and ``x-toy-trace``. Returns the bytes of every answer."""
    turns: list[dict[str, Any]] = [{"kind": "ask", "text": question}]
    answers: list[bytes] = []
    with httpx.Client(base_url=url, timeout=30,
                      headers={"authorization": f"Bearer {KEY}"}) as http:
        for stream in streams:
            body = {"model": MODEL, "rules": RULES, "turns": turns, "stream": stream,
                    "nonce": uuid.uuid4().hex}
            with http.stream("POST", ENDPOINT, json=body,
                             headers={"x-toy-trace": uuid.uuid4().hex}) as response:
                raw = b"".join(response.iter_bytes())
            response.raise_for_status()
            answers.append(raw)
            said = _reply_turns(raw, stream)
            turns = [*turns, *said]
            calls = [t for t in said if t["kind"] == "call"]
            if not calls:
                break
            turns += [{"kind": "result", "id": c["id"], "output": tool(**c["args"])}
                      for c in calls]
    return answers
