"""An agent that puts a secret everywhere deja writes something: the secret scan's agent.

It is run unmodified under ``deja record`` and imported for ``recorder.record``; the
secrets and the URLs it talks to come from the JSON file named by ``SECRET_AGENT_CONFIG``
(never from its command line, which only carries secrets for deja to redact from the
cassette header). It talks to the stub model (JSON, an echo, an SSE stream whose tool
input carries a secret cut into pieces) and to a plain HTTP service (query strings,
userinfo, secret-bearing response bodies and headers), calls tools with secrets in their
arguments, results and errors, asks for an effect, and keeps one tool call in flight until
its run's status record shows it, copying that record aside for the scan.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import anthropic
import httpx2
import requests

import recorder

MODEL = "claude-sonnet-4-6"


def config() -> dict[str, Any]:
    return json.loads(Path(os.environ["SECRET_AGENT_CONFIG"]).read_text())


@recorder.tool
def lookup(token: str, query: str) -> dict[str, Any]:
    s = config()["secrets"]
    return {"hits": 1,
            "reset_link": f"https://accounts.example/reset?token={s['tool_result_query']}",
            "note": f"use {s['tool_result_shape']} for maps",
            "ini": f"aws_secret_access_key = {s['aws_secret']}"}


@recorder.tool
def fetch_profile(user: str) -> str:
    raise PermissionError(f"upstream refused {user}: Authorization: Bearer "
                          f"{config()['secrets']['tool_error_jwt']}")


@recorder.tool
def slow(credential: str) -> str:
    """Stays in flight until this run's status record names it, and keeps a copy."""
    cfg = config()
    runs = Path(os.environ["DEJA_HOME"]) / "runs"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        for path in sorted(runs.glob("*.json")):
            try:
                text = path.read_text()
                record = json.loads(text)
            except (OSError, ValueError):
                continue
            if str(record.get("step", "")).startswith("tool slow(") \
                    and record.get("status") == "running":
                out = Path(cfg["snapshot_dir"]) / f"{os.getpid()}-{time.time_ns()}.json"
                out.write_text(text)
                return "done"
        time.sleep(0.02)
    raise TimeoutError("the status record never showed the tool call in flight")


def run() -> str:
    cfg = config()
    s = cfg["secrets"]
    client = anthropic.Anthropic(
        base_url=cfg["model_url"], max_retries=0,
        default_headers={"x-tenant": s["flag_header"], "x-request-note": s["header_shape"]})
    with client:
        # 1. a JSON call whose body holds secrets, with a secret query parameter; the stub
        #    echoes the user's text back, secrets and all
        echo = client.messages.create(
            model=MODEL, max_tokens=256, metadata={"user_id": s["body_path"]},
            extra_query={"api_key": s["model_query"]},
            messages=[{"role": "user", "content": (
                f"my access key is {s['body_shape']}, the corp id corp-{s['pyproject_pattern']}"
                f", tenant-{s['flag_pattern_group']}, and echo {s['echo']} please")}])
        # 2. a streamed turn whose tool input (a secret) arrives in pieces
        messages: list[dict[str, Any]] = [{"role": "user", "content": "find the token"}]
        with client.messages.stream(model=MODEL, max_tokens=256, messages=messages) as stream:
            reply = stream.get_final_message()
        use = next(b for b in reply.content if b.type == "tool_use")
        result = lookup(**use.input)
        try:
            fetch_profile("ada")
        except PermissionError as exc:
            refused = str(exc)
        slow(s["status_flight"])
        token = recorder.value("session_token", lambda: s["effect"])
        # 3. plain HTTP: secrets in query strings and userinfo; answers carrying secrets
        base = cfg["http_url"]
        found = requests.get(f"{base}/search", params={
            "q": "x", "key": s["query_key"], "session_ref": s["flag_query"]}, timeout=10).json()
        host = base.split("://", 1)[1]
        me = httpx2.get(f"http://svc:{s['userinfo']}@{host}/me", timeout=10).text
        me2 = requests.get(f"http://admin:{s['userinfo_requests']}@{host}/me", timeout=10).text
        messages += [{"role": "assistant", "content": [b.model_dump() for b in reply.content]},
                     {"role": "user", "content": [{"type": "tool_result",
                                                   "tool_use_id": use.id,
                                                   "content": json.dumps(result)}]}]
        final = client.messages.create(model=MODEL, max_tokens=256, messages=messages)
    return json.dumps({"echo": echo.content[0].text, "result": result, "refused": refused,
                       "token": token, "found": found, "me": [me, me2],
                       "final": final.content[0].text})


if __name__ == "__main__":
    out = run()
    sys.stdout.write(f"{len(out)} characters of answers\n")
