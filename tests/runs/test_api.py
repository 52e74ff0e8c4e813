"""``deja serve`` and its command-line clients, end to end: a real ``python -m deja serve``
and a real ``python -m deja worker`` (their own ``DEJA_HOME`` under the test's temporary
directory), small agents that need no model (``recorder.now``, ``recorder.ask``, a tool,
``recorder.artefact``), and the commands a person types."""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from deja.runs.auth import read_token

ASK_AGENT = '''\
import pathlib, time
import recorder

started = recorder.now()
time.sleep(0.8)  # working, long enough to be seen
answer = recorder.ask("Ship the weekly report?")
pathlib.Path("report.txt").write_text(f"shipped: {answer} (started {started})\\n")
recorder.artefact("report.txt")
time.sleep(0.8)
'''

LOOP_AGENT = '''\
import time
import recorder

@recorder.tool
def tick(i):
    time.sleep(0.1)
    return i

for i in range(600):
    recorder.now()
    tick(i)
'''


@dataclass
class Proc:
    """A ``deja`` process of a test, its log in a file."""

    process: subprocess.Popen[bytes]
    log_path: Path
    url: str = ""

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class Deja:
    """Start ``deja serve`` and ``deja worker`` processes and run ``deja`` commands, in
    ``work`` (the agents' directory), with this test's environment."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.work = tmp_path / "work"
        self.work.mkdir()
        (self.work / "ask_agent.py").write_text(ASK_AGENT)
        (self.work / "loop_agent.py").write_text(LOOP_AGENT)
        self.procs: list[Proc] = []
        self.env: dict[str, str] = {}

    def _start(self, name: str, args: list[str], env: dict[str, str] | None) -> Proc:
        log_path = self.tmp / f"{name}-{len(self.procs)}.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen([sys.executable, "-m", "deja", *args], cwd=self.work,
                                       stdout=log, stderr=subprocess.STDOUT,
                                       env={**os.environ, **self.env, **(env or {})})
        proc = Proc(process, log_path)
        self.procs.append(proc)
        return proc

    def serve(self, *args: str, env: dict[str, str] | None = None) -> Proc:
        ready = self.tmp / f"serve-{len(self.procs)}.ready"
        proc = self._start("serve", ["serve", "--port", "0", "--ready-file", str(ready),
                                     *args], env)
        wait_for(lambda: ready.is_file() or proc.process.poll() is not None, 30,
                 lambda: proc.log())
        assert proc.process.poll() is None, proc.log()
        proc.url = json.loads(ready.read_text())["url"]
        assert f"deja: serving runs on {proc.url}" in proc.log()
        self.env["DEJA_SERVER"] = proc.url
        return proc

    def worker(self, worker_id: str = "w1") -> Proc:
        proc = self._start("worker", ["worker", "--id", worker_id], None)
        wait_for(lambda: "is up" in proc.log() or proc.process.poll() is not None, 30,
                 lambda: proc.log())
        assert proc.process.poll() is None, proc.log()
        return proc

    def __call__(self, *args: str, env: dict[str, str] | None = None,
                 extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, *extra, "-m", "deja", *args], cwd=self.work,
                              capture_output=True, text=True, timeout=60,
                              env={**os.environ, **self.env, **(env or {})})

    def stop(self) -> None:
        for proc in self.procs:
            proc.stop()


@pytest.fixture
def deja(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Deja]:
    # (DEJA_SERVER stays the address nothing serves until the test starts a server)
    for name in ("DEJA_TOKEN", "DEJA_DATABASE_URL", "DEJA_CASSETTE_DIR"):
        monkeypatch.delenv(name, raising=False)
    d = Deja(tmp_path)
    yield d
    d.stop()
    for proc in d.procs:  # a worker's log holds its agents' output: only the server's
        if proc.log_path.name.startswith("serve"):
            assert "Traceback" not in proc.log(), proc.log()


def wait_for(done: Callable[[], Any], timeout: float, say: Callable[[], str] = str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = done()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"not done within {timeout}s\n{say()}")


OWN = "the install's token"


def api(method: str, url: str, body: Any = None, *, raw: bytes | None = None,
        token: str | None = OWN, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """One request to the API, as deja's own clients send it (this install's token, a
    JSON body) unless told otherwise; its status and JSON body."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    request = urllib.request.Request(url, data=data, method=method)
    if token == OWN:
        token = read_token()
    if token is not None:
        request.add_header("authorization", f"Bearer {token}")
    if method == "POST":
        request.add_header("content-type", "application/json")
    for key, value in (headers or {}).items():
        request.add_header(key, value)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, json.loads(exc.read())


def follow(url: str, run: str, events: list[tuple[str, dict[str, Any]]]) -> threading.Thread:
    """Read ``GET /runs/RUN/events`` in a thread until the server ends the stream."""
    host, port = url.removeprefix("http://").rsplit(":", 1)

    def read() -> None:
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request("GET", f"/runs/{run}/events",
                     headers={"authorization": f"Bearer {read_token()}"})
        response = conn.getresponse()
        assert response.status == 200
        assert response.getheader("content-type") == "text/event-stream"
        name = None
        while line := response.readline():
            text = line.decode().rstrip("\n")
            if text.startswith("event: "):
                name = text[len("event: "):]
            elif text.startswith("data: ") and name is not None:
                events.append((name, json.loads(text[len("data: "):])))
        events.append(("eof", {}))
        conn.close()

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def watch(url: str, run: str, until: Callable[[dict[str, Any]], bool],
          timeout: float = 30) -> tuple[dict[str, Any], list[str]]:
    """Poll ``GET /runs/RUN`` until ``until(record)``; the record and the statuses seen."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while True:
        status, record = api("GET", f"{url}/runs/{run}")
        assert status == 200, record
        if not seen or seen[-1] != record["status"]:
            seen.append(record["status"])
        if until(record):
            return record, seen
        assert time.monotonic() < deadline, (record, seen)
        time.sleep(0.1)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_submitted_run_waits_for_an_answer_and_completes_with_its_artefact(
        deja: Deja) -> None:
    server = deja.serve()
    submitted = deja("submit", "--label", "team=billing", "--max-turns", "5", "--",
                     "python", "ask_agent.py")
    assert submitted.returncode == 0, submitted.stderr
    run = submitted.stdout.strip()
    assert run.startswith("r_") and f"deja status {run}" in submitted.stderr
    record, _ = watch(server.url, run, lambda r: True)
    assert record["status"] == "queued" and record["labels"] == {"team": "billing"}
    assert record["command"] == ["python", "ask_agent.py"]
    events: list[tuple[str, dict[str, Any]]] = []
    stream = follow(server.url, run, events)
    queued = json.loads(deja("runs", "--status", "queued", "--json").stdout)["runs"]
    assert [r["run_id"] for r in queued] == [run]

    deja.worker("w1")  # only now does anyone take the run
    record, seen = watch(server.url, run, lambda r: r["status"] == "input_required")
    assert seen[:3] == ["queued", "working", "input_required"], seen
    assert record["question"] == "Ship the weekly report?" and record["worker"] == "w1"
    assert record["answer"] == f"deja answer {run} TEXT"
    shown = deja("status", run)  # the agent's process is gone: deja serve tells
    assert shown.returncode == 0, shown.stderr
    assert f"run {run}: input_required" in shown.stdout
    assert "question: Ship the weekly report?" in shown.stdout

    # The event stream polls; let it report the wait before the answer ends it.
    deadline = time.monotonic() + 30
    while not any(data.get("status") == "input_required" for _, data in list(events)):
        assert time.monotonic() < deadline, events
        time.sleep(0.1)
    answered = deja("answer", run, "yes, ship it")
    assert answered.returncode == 0, answered.stderr
    assert "answered run" in answered.stdout and "Ship the weekly report?" in answered.stdout
    record, seen = watch(server.url, run, lambda r: r["status"] == "completed")
    assert "working" in seen, seen
    report = deja.work / "report.txt"
    assert report.read_text().startswith("shipped: yes, ship it")
    assert record["artefacts"] == [{"path": "report.txt", "bytes": report.stat().st_size,
                                    "sha256": hashlib.sha256(report.read_bytes()).hexdigest()}]
    assert Path(record["cassette"]).is_file() and record["ended"]

    stream.join(15)
    assert not stream.is_alive(), events
    names = [name for name, _ in events]
    assert names[-1] == "eof" and set(names[:-1]) == {"status"}, names
    statuses = [data["status"] for _, data in events[:-1]]
    assert statuses[0] == "queued" and statuses[-1] == "completed", statuses
    assert "input_required" in statuses and "working" in statuses, statuses

    def listed(*args: str) -> list[str]:
        done = deja("runs", "--json", *args)
        assert done.returncode == 0, done.stderr
        return [r["run_id"] for r in json.loads(done.stdout)["runs"]]

    assert listed("--status", "completed", "--label", "team=billing") == [run]
    assert listed("--status", "working", "--status", "queued") == []
    assert listed("--label", "team=other") == []
    table = deja("runs")
    assert table.returncode == 0 and run in table.stdout and "completed" in table.stdout
    as_json = json.loads(deja("status", run, "--json", env={  # not known here: asked
        "DEJA_HOME": str(deja.tmp / "elsewhere"), "DEJA_TOKEN": str(read_token())}).stdout)
    assert as_json["status"] == "completed" and as_json["run_id"] == run


def test_cancel_a_queued_run_it_never_starts_and_a_working_one_it_stops(deja: Deja) -> None:
    server = deja.serve()
    queued = deja("submit", "--", "python", "ask_agent.py").stdout.strip()
    cancelled = deja("cancel", queued)
    assert cancelled.returncode == 0, cancelled.stderr
    assert f"run {queued} cancelled (it was queued; it never starts)" in cancelled.stdout
    assert api("GET", f"{server.url}/runs/{queued}")[1]["status"] == "cancelled"

    looping = deja("submit", "--", "python", "loop_agent.py").stdout.strip()
    deja.worker("w1")
    record, _ = watch(server.url, looping, lambda r: r["status"] == "working" and
                      Path(r["cassette"]).is_file())
    time.sleep(0.5)  # a few of its ticks recorded
    elsewhere = {"DEJA_HOME": str(deja.tmp / "elsewhere"),  # another machine: asks deja serve
                 "DEJA_TOKEN": str(read_token())}
    stopping = deja("cancel", looping, env=elsewhere)
    assert stopping.returncode == 0, stopping.stderr
    assert "cancel requested" in stopping.stdout and "it was working" in stopping.stdout
    record, _ = watch(server.url, looping, lambda r: bool(r.get("ended")), timeout=20)
    assert record["status"] == "cancelled"
    last = json.loads(Path(record["cassette"]).read_text().splitlines()[-1])
    assert last["kind"] == "end" and last["status"] == "cancelled"
    again = deja("cancel", looping, env=elsewhere)
    assert again.returncode == 2 and "already ended" in again.stderr

    # the worker served the queue, and the cancelled run was never started
    status, record = api("GET", f"{server.url}/runs/{queued}")
    assert status == 200 and record["status"] == "cancelled"
    assert not Path(record["cassette"]).exists() and record["worker"] is None


def test_bad_input_is_a_named_error(deja: Deja) -> None:
    server = deja.serve()
    url = server.url
    status, body = api("GET", f"{url}/runs/r_000000000000deadbeef")
    assert status == 404 and body["error"]["type"] == "NoSuchRun"
    assert "deja runs" in body["error"]["message"]
    for args in (("status", "r_000000000000deadbeef"), ("cancel", "r_000000000000deadbeef"),
                 ("answer", "r_000000000000deadbeef", "yes")):
        done = deja(*args)
        assert done.returncode == 2 and "NoSuchRun" in done.stderr, (args, done.stderr)
        assert "Traceback" not in done.stderr
    assert api("GET", f"{url}/runs/r_000000000000deadbeef/events")[0] == 404

    cases: list[tuple[bytes, int, str, str]] = [
        (b"{not json", 400, "BadJson", "not JSON"),
        (b'{"command": "python agent.py"}', 400, "BadRunRequest", "not one string"),
        (b'{"command": ["python", "a.py"], "guards": {"max_pizzas": 3}}', 400,
         "BadRunRequest", "unknown guard 'max_pizzas'"),
        (json.dumps({"command": ["python", "a.py", "--api-key", "sk-ant-api03-xxxxxxxxxxxx"]})
         .encode(), 400, "BadRunRequest", "looks like a secret"),
        (b'{"command": ["python"], "cwd": "relative/dir"}', 400, "BadRunRequest", "absolute"),
    ]
    for raw, code, kind, says in cases:
        status, body = api("POST", f"{url}/runs", raw=raw)
        assert (status, body["error"]["type"]) == (code, kind), (raw[:60], body)
        assert says in body["error"]["message"], body
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.putrequest("POST", "/runs")  # 2 MiB announced: refused before it is sent
    conn.putheader("content-length", str(2 * 1024 * 1024))
    conn.putheader("content-type", "application/json")
    conn.putheader("authorization", f"Bearer {read_token()}")
    conn.endheaders()
    response = conn.getresponse()
    body = json.loads(response.read())
    conn.close()
    assert response.status == 413 and body["error"]["type"] == "BodyTooLarge"
    assert "1048576 bytes" in body["error"]["message"]
    secret = deja("submit", "--", "python", "agent.py", "--api-key", "sk-ant-api03-xxxxxxxxxx")
    assert secret.returncode == 2 and "BadRunRequest" in secret.stderr
    assert "worker's environment" in secret.stderr
    assert api("GET", f"{url}/runs")[1] == {"runs": []}  # nothing was stored

    assert api("GET", f"{url}/nowhere")[1]["error"]["type"] == "NotFound"
    assert api("DELETE", f"{url}/runs")[0] == 405
    for query in ("limit=many", "status=sleeping", "label=nokey", "colour=red"):
        status, body = api("GET", f"{url}/runs?{query}")
        assert status == 400 and body["error"]["type"] == "BadRunRequest", (query, body)
    bad_status = deja("runs", "--status", "sleeping")
    assert bad_status.returncode == 2 and "unknown status sleeping" in bad_status.stderr
    run = api("POST", f"{url}/runs", {"command": ["python", "ask_agent.py"],
                                      "cwd": str(deja.work)})[1]["run_id"]
    status, body = api("POST", f"{url}/runs/{run}/input", {"text": "yes"})
    assert status == 400 and '{"answer": "TEXT"}' in body["error"]["message"]
    assert api("GET", f"{url}/schedules") == (200, {"schedules": []})
    assert api("GET", f"{url}/healthz") == (200, {"ok": True, "database": "sqlite"})
    assert deja("submit").returncode == 2  # no command: click's usage error
    typo = deja("submit", "--max-turn", "3", "--", "python", "a.py")
    assert typo.returncode == 2 and "go after --" in typo.stderr


def test_submit_is_fast(deja: Deja) -> None:
    server = deja.serve("--quiet")
    body = {"command": ["python", "ask_agent.py"], "cwd": str(deja.work)}
    times = []
    for _ in range(30):
        t0 = time.perf_counter()
        status, answer = api("POST", f"{server.url}/runs", body)
        times.append(time.perf_counter() - t0)
        assert status == 201 and answer["status"] == "queued"
    assert statistics.median(times) <= 0.040, sorted(times)
    assert len(api("GET", f"{server.url}/runs?limit=1000")[1]["runs"]) == 30


def test_a_token_is_required_off_loopback_and_checked_when_given(deja: Deja) -> None:
    refused = deja("serve", "--host", "0.0.0.0", "--port", "0")
    assert refused.returncode == 2 and "not loopback" in refused.stderr
    assert "--token" in refused.stderr and "Traceback" not in refused.stderr
    token = "s3cret-token-of-this-test"
    server = deja.serve("--token", token)
    status, body = api("GET", f"{server.url}/runs", token=None)
    assert status == 401 and body["error"]["type"] == "Unauthorized"
    assert api("GET", f"{server.url}/runs", token="wrong")[0] == 401
    assert api("POST", f"{server.url}/runs", {"command": ["true"]}, token=None)[0] == 401
    assert api("GET", f"{server.url}/runs", token=token) == (200, {"runs": []})
    assert api("GET", f"{server.url}/healthz")[0] == 200
    denied = deja("runs")
    assert denied.returncode == 2 and "Unauthorized" in denied.stderr
    assert "DEJA_TOKEN" in denied.stderr
    allowed = deja("runs", "--json", env={"DEJA_TOKEN": token})
    assert allowed.returncode == 0 and json.loads(allowed.stdout) == {"runs": []}


def test_submit_without_a_server_says_how_to_start_one_and_stays_light(deja: Deja) -> None:
    address = f"http://127.0.0.1:{free_port()}"
    done = deja("submit", "--", "python", "ask_agent.py", env={"DEJA_SERVER": address},
                extra=("-X", "importtime"))
    assert done.returncode == 2
    assert "ServerUnreachable" in done.stderr and address in done.stderr
    assert "start it with `deja serve`" in done.stderr
    imported = {line.split("|")[-1].strip() for line in done.stderr.splitlines()
                if line.startswith("import time:")}
    assert "deja.runs.errors" in imported  # the client's path to the server was taken
    heavy = {m for m in imported if m.split(".")[0] in ("dbos", "sqlalchemy", "psycopg")
             or m in ("deja.runs.engine", "deja.runs.store", "deja.runs.api")}
    assert not heavy, sorted(heavy)
    for args in (("answer", "r_000000000000deadbeef", "yes"), ("runs",)):
        done = deja(*args, env={"DEJA_SERVER": address})
        assert done.returncode == 2 and "ServerUnreachable" in done.stderr, done.stderr
    unknown = deja("status", "r_000000000000deadbeef", env={"DEJA_SERVER": address})
    assert unknown.returncode == 2 and "no status for run" in unknown.stderr
    assert "does not answer" in unknown.stderr
