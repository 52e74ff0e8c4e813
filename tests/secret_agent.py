"""An agent that puts a secret everywhere deja writes something: the secret scan's agent,
the 51 placements it scans for, and the scan.

It is run unmodified under ``deja record`` and imported for ``recorder.record``; the
secrets and the URLs it talks to come from the JSON file named by ``SECRET_AGENT_CONFIG``
(never from its command line, which only carries secrets for deja to redact from the
cassette header). It talks to the stub model (JSON, an echo, an SSE stream whose tool
input carries a secret cut into pieces), to a plain HTTP service (query strings,
userinfo, secret-bearing response bodies and headers, JSON fields named like secrets)
that also streams OpenAI Chat Completions and Responses with secrets in 3-character
pieces, calls tools with secrets in their arguments, results and errors, asks for effects,
and keeps one tool call in flight until its run's status record shows it, copying that
record aside for the scan.

:func:`placements` gives the 51 secrets, one per place; :func:`leaks` looks for each in
clear, base64 at the three alignments (standard and urlsafe) and URL-encoded, in every
file given; :class:`OtlpReceiver` is a real OTLP/HTTP endpoint that keeps what it is sent
as files, so that ``deja export`` is scanned too. The runs database's placements
(:data:`RUNS_PLACEMENTS`) are made by ``tests/runs/test_runs_secrets.py``.
"""

from __future__ import annotations

import base64
import gzip
import json
import os
import random
import string
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import anthropic
import httpx2
import openai
import requests

import recorder

MODEL = "claude-sonnet-4-6"
OPENAI_MODEL = "gpt-4o"


def config() -> dict[str, Any]:
    return json.loads(Path(os.environ["SECRET_AGENT_CONFIG"]).read_text())


@recorder.tool
def lookup(token: str, query: str) -> dict[str, Any]:
    s = config()["secrets"]
    return {"hits": 1,
            "reset_link": f"https://accounts.example/reset?token={s['tool_result_query']}",
            "note": f"use {s['tool_result_shape']} for maps",
            "ini": f"aws_secret_access_key = {s['aws_secret']}",
            "hub": f"the model hub answers to {s['shape_hf']}"}


@recorder.tool
def fetch_profile(user: str) -> str:
    raise PermissionError(f"upstream refused {user}: Authorization: Bearer "
                          f"{config()['secrets']['tool_error_jwt']}")


@recorder.tool
def connect(host: str, password: str) -> dict[str, Any]:
    s = config()["secrets"]
    return {"token": s["json_token"],
            "how": f"curl -H 'Authorization: Basic {s['basic_auth']}' https://{host}/"}


@recorder.tool
def login(host: str) -> str:
    raise ConnectionError(f"login to {host} failed: password={config()['secrets']['exc_password']}")


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


def _openai(base: str, s: dict[str, str]) -> dict[str, Any]:
    """A Chat Completions stream and a Responses stream, each with its text and a tool
    call's arguments in 3-character pieces (the service sends them so)."""
    with openai.OpenAI(base_url=f"{base}/v1", api_key="sk-test", max_retries=0) as client:
        chunks = client.chat.completions.create(model=OPENAI_MODEL, stream=True, messages=[
            {"role": "user", "content": f"publish with {s['shape_npm']}"}])
        text, args = "", ""
        for chunk in chunks:
            for choice in chunk.choices:
                text += choice.delta.content or ""
                for call in choice.delta.tool_calls or []:
                    args += (call.function.arguments or "") if call.function else ""
        events = client.responses.create(model=OPENAI_MODEL, input="and the other one?",
                                         stream=True)
        said, called = "", ""
        for event in events:
            if event.type == "response.output_text.delta":
                said += event.delta
            elif event.type == "response.function_call_arguments.delta":
                called += event.delta
    return {"chat": text, "chat_args": args, "responses": said, "responses_args": called}


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
                f", tenant-{s['flag_pattern_group']}, the app token {s['shape_xapp']}"
                f", and echo {s['echo']} please")}])
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
        linked = connect(host="db.internal", password=s["json_password"])
        try:
            login("db.internal")
        except ConnectionError as exc:
            refused += f"; {exc}"
        slow(s["status_flight"])
        token = recorder.value("session_token", lambda: s["effect"])
        settings = recorder.value("client_config", lambda: {"apiKey": s["json_api_key_camel"]})
        # 3. plain HTTP: secrets in query strings and userinfo; answers carrying secrets
        base = cfg["http_url"]
        found = requests.get(f"{base}/search", params={
            "q": "x", "key": s["query_key"], "session_ref": s["flag_query"]}, timeout=10).json()
        host = base.split("://", 1)[1]
        me = httpx2.get(f"http://svc:{s['userinfo']}@{host}/me", timeout=10).text
        me2 = requests.get(f"http://admin:{s['userinfo_requests']}@{host}/me", timeout=10).text
        sts = requests.get(f"{base}/sts", params={"access_key": s["query_access_key"]},
                           timeout=10)
        granted = requests.post(f"{base}/oauth/token", timeout=10, json={
            "client_id": "deja", "client_secret": s["json_client_secret"]}).json()
        # 4. OpenAI streams with secrets in 3-character pieces
        streamed = _openai(base, s)
        messages += [{"role": "assistant", "content": [b.model_dump() for b in reply.content]},
                     {"role": "user", "content": [{"type": "tool_result",
                                                   "tool_use_id": use.id,
                                                   "content": json.dumps(result)}]}]
        final = client.messages.create(model=MODEL, max_tokens=256, messages=messages)
    return json.dumps({"echo": echo.content[0].text, "result": result, "refused": refused,
                       "linked": linked, "token": token, "settings": settings, "found": found,
                       "me": [me, me2], "sts": sts.json(), "webhook": sts.headers["x-webhook"],
                       "granted": granted, "streamed": streamed,
                       "final": final.content[0].text})


# ------------------------------------------------------------------------ placements

# Made by the runs scan (tests/runs/test_runs_secrets.py): a submitted run's label, a
# question and its answer (recorder.ask), a failed run's error.
RUNS_PLACEMENTS = ("runs_label", "ask_question", "ask_answer", "runs_error")


def _random(rng: random.Random, n: int, alphabet: str = string.ascii_letters + string.digits
            ) -> str:
    return "".join(rng.choice(alphabet) for _ in range(n))


def placements() -> dict[str, str]:
    """One distinct secret per place deja writes something (51)."""
    rng = random.Random(2025)
    hexs = string.hexdigits[:16]
    upper = string.ascii_uppercase + string.digits

    def r(n: int, a: str = string.ascii_letters + string.digits) -> str:
        return _random(rng, n, a)

    out = {
        "env_api_key": f"envkey{r(20)}",                     # ANTHROPIC_API_KEY, a header
        "flag_header": f"hdr{r(20)}",                        # --redact-header x-tenant
        "header_shape": f"xoxb-{r(12, string.digits)}-{r(24)}",  # a key in another header
        "model_query": f"mq{r(20)}",                         # ?api_key= on the model call
        "query_key": f"qk{r(20)}",                           # ?key= on an HTTP call
        "flag_query": f"sr{r(20)}",                          # --redact-query session_ref
        "userinfo": f"ui{r(20)}",                            # http://svc:SECRET@host (httpx)
        "userinfo_requests": f"ur{r(20)}",                   # the same through requests
        "argv_option": f"ao{r(20)}",                         # --api-key SECRET in the argv
        "argv_shape": f"sk-ant-api03-{r(40)}",               # a key as a program argument
        "label": f"ghr_{r(36)}",                             # --label ci_token=SECRET
        "cwd": f"ghs_{r(36)}",                               # the working directory's name
        "body_shape": f"AKIA{r(16, upper)}",                 # a request body
        "echo": f"sk-proj-{r(40)}",                          # echoed back by the model
        "body_path": f"bp{r(20)}",                           # --redact-body /metadata/user_id
        "pyproject_pattern": r(16, hexs.lower()),            # [tool.deja.redact] patterns
        "flag_pattern_group": r(20),                         # --redact-pattern with a group
        "stream_split": f"ghp_{r(36)}",                      # tool input streamed in pieces,
        "tool_result_query": f"rt{r(20)}",                   # then tool args; ?token= in a
        "tool_result_shape": f"AIza{r(35)}",                 # tool result; a key in it;
        "aws_secret": r(40, string.ascii_letters + string.digits + "/+"),  # aws_secret_...=
        "tool_error_jwt": f"eyJ{r(20)}.eyJ{r(30)}.{r(43)}",  # a tool's exception message
        "status_flight": f"sk_live_{r(30)}",                 # a status record mid-call
        "effect": f"github_pat_{r(22)}_{r(40)}",             # an effect value
        "http_response_body": f"ASIA{r(16, upper)}",         # an HTTP response body
        "http_response_header": f"{r(30)}9",                 # Bearer ... in a response header
        "cookie": f"ck{r(20)}",                              # set-cookie
        # OpenAI streams, in 3-character pieces: a Chat choice's text and a tool call's
        # arguments, a Responses message's text and a function call's arguments
        "openai_chat_stream": f"sk-proj-{r(48)}",
        "openai_chat_args": f"oc{r(7)}9{r(12)}",             # {"password": ...}
        "openai_responses_stream": f"ya29.a0{r(60)}",
        "openai_responses_args": f"or{r(7)}7{r(12)}",        # {"api_key": ...}
        # JSON fields named like secrets
        "json_secret_access_key": r(40, string.ascii_letters + string.digits + "/+"),
        "json_password": f"pw{r(7)}3{r(8)}",                 # a tool's argument
        "json_client_secret": f"cs{r(24)}",                  # an HTTP request body
        "json_token": f"tk{r(7)}5{r(16)}",                   # a tool's result, {"token": ...}
        "json_api_key_camel": f"ak{r(24)}",                  # an effect value, {"apiKey": ...}
        "json_refresh_token": f"rf{r(30)}",                  # {"refreshToken": ...} answered
        # more shapes
        "shape_xapp": f"xapp-1-A{r(10, upper)}-{r(13, string.digits)}-{r(64, hexs.lower())}",
        "shape_whsec": f"whsec_{r(32)}",                     # a response header
        "shape_hf": f"hf_{r(34)}",                           # a tool result
        "shape_npm": f"npm_{r(36)}",                         # an OpenAI request body
        "basic_auth": base64.b64encode(f"deploy:{r(16)}".encode()).decode(),  # Basic ...
        "query_access_key": f"qa{r(20)}",                    # ?access_key=
        # the command line
        "argv_p": f"pp{r(6)}4{r(8)}",                        # -p SECRET
        "argv_password": f"pa{r(20)}",                       # --password SECRET
        "argv_password_eq": f"pe{r(20)}",                    # --password=SECRET
        "exc_password": f"ep{r(7)}8{r(10)}",                 # password=... in an exception
        # the runs database (RUNS_PLACEMENTS)
        "runs_label": f"rl{r(20)}",                          # {"db_password": ...} label
        "ask_question": f"aq{r(7)}2{r(10)}",                 # "...password=SECRET?"
        "ask_answer": f"ghp_{r(36)}",                        # the answer to recorder.ask
        "runs_error": f"re{r(7)}6{r(10)}",                   # a failed run's error text
    }
    assert len(out) == 51 and len(set(out.values())) == 51
    return out


# ------------------------------------------------------------------------ the scan


def forms(secret: str) -> list[bytes]:
    """The bytes a secret shows up as: in clear; base64 of it, of ``x`` + it and of ``xx``
    + it (the three alignments inside a longer blob), with the characters that mix with
    neighbours dropped, standard and urlsafe; URL-encoded."""
    data = secret.encode()
    found = [data]
    for pad in range(3):
        encoded = base64.b64encode(b"x" * pad + data)
        core = encoded[4 if pad else 0:len(encoded) - 4]
        found += [core, core.replace(b"+", b"-").replace(b"/", b"_")]
    found += [base64.b64encode(data), base64.urlsafe_b64encode(data)]
    found += [urllib.parse.quote(secret, safe="").encode(),
              urllib.parse.quote_plus(secret).encode()]
    return list(dict.fromkeys(f for f in found if len(f) >= 8))


def leaks(secrets: dict[str, str], files: list[Path]) -> list[str]:
    """Every (secret, file, form) found."""
    found = []
    for path in files:
        data = path.read_bytes()
        for name, secret in secrets.items():
            found += [f"{name} as {form[:24]!r}... in {path}" for form in forms(secret)
                      if form in data]
    return found


class OtlpReceiver:
    """An OTLP/HTTP traces endpoint on 127.0.0.1 that keeps each body it is sent (gzip
    undone) as a file in ``folder``."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.files: list[Path] = []
        received = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                path = folder / f"export-{len(received.files)}.pb"
                path.write_bytes(body)
                received.files.append(path)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def __enter__(self) -> OtlpReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


if __name__ == "__main__":
    out = run()
    sys.stdout.write(f"{len(out)} characters of answers\n")
