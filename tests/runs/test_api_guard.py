"""Who may call ``deja serve``, through a real ``python -m deja serve``: the per-install
token on every route (loopback too), the ``Host``, ``Origin`` and ``Content-Type`` checks,
bodies that no database or command line can hold, the namespace of submitted run ids, and
an event stream resumed where it dropped. No worker runs: a refused submission leaves no
row, so nothing could ever run it (the browser test shows it with a worker up).

The checks of one request share one server (:func:`served`, its own ``DEJA_HOME``); the
tests of the token's making start their own."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from test_api import Deja, api, deja  # noqa: F401 (the deja fixture)

from deja.runs.auth import read_token

RUN = {"command": ["python", "ask_agent.py"]}


@dataclass
class Served:
    """The shared server: its address, its token, the agents' directory."""

    url: str
    token: str
    work: Path
    deja: Deja

    def api(self, method: str, path: str, body: Any = None, **given: Any) -> tuple[int, Any]:
        return api(method, self.url + path, body, **{"token": self.token, **given})

    def rows(self) -> set[str]:
        status, body = self.api("GET", "/runs?limit=1000")
        assert status == 200, body
        return {r["run_id"] for r in body["runs"]}

    def submit(self, **extra: Any) -> str:
        status, body = self.api("POST", "/runs", {**RUN, "cwd": str(self.work), **extra})
        assert status == 201, body
        return str(body["run_id"])


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    home = tmp_path_factory.mktemp("served-home")
    d = Deja(tmp_path_factory.mktemp("served"))
    d.env.update(DEJA_HOME=str(home), DEJA_TOKEN="", DEJA_DATABASE_URL="",
                 DEJA_CASSETTE_DIR="")
    server = d.serve("--allowed-host", "deja.internal")
    try:
        yield Served(server.url, (home / "serve.token").read_text().strip(), d.work, d)
    finally:
        d.stop()
    assert "Traceback" not in server.log() and " 500 " not in server.log(), server.log()


def raw_request(url: str, method: str, path: str, body: bytes | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """One request with exactly these headers (``Host`` included when given)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    given = {k.lower(): v for k, v in (headers or {}).items()}
    conn.putrequest(method, path, skip_host="host" in given, skip_accept_encoding=True)
    for key, value in given.items():
        conn.putheader(key, value)
    if body is not None:
        conn.putheader("content-length", str(len(body)))
    conn.endheaders(body)
    response = conn.getresponse()
    data = response.read()
    conn.close()
    return response.status, {k.lower(): v for k, v in response.getheaders()}, data


def named(data: bytes) -> str:
    return str(json.loads(data)["error"]["type"])


def rows(url: str) -> list[str]:
    status, body = api("GET", f"{url}/runs?limit=1000")
    assert status == 200, body
    return [r["run_id"] for r in body["runs"]]


def test_every_route_needs_the_install_token_even_on_loopback(
        deja: Deja, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    home = tmp_path / "fresh-home"  # a fresh install: deja serve makes the token
    monkeypatch.setenv("DEJA_HOME", str(home))
    server = deja.serve()
    token_file = home / "serve.token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    token = read_token()
    assert token is not None and len(token) >= 40

    run = api("POST", f"{server.url}/runs", {**RUN, "cwd": str(deja.work)})[1]["run_id"]
    routes = [("POST", "/runs", {**RUN, "cwd": str(deja.work)}), ("GET", "/runs", None),
              ("GET", f"/runs/{run}", None), ("POST", f"/runs/{run}/cancel", {}),
              ("POST", f"/runs/{run}/input", {"answer": "yes"}),
              ("GET", f"/runs/{run}/events", None), ("GET", "/schedules", None)]
    for method, path, body in routes:
        for wrong in (None, "wrong", token[:-1], f"{token}x"):
            status, answer = api(method, server.url + path, body, token=wrong)
            assert (status, answer["error"]["type"]) == (401, "Unauthorized"), (path, wrong)
            assert "deja serve --print-token" in answer["error"]["message"]
    _, headers, data = raw_request(server.url, "GET", "/runs", headers={
        "authorization": f"Basic {token}"})
    assert named(data) == "Unauthorized" and headers["www-authenticate"].startswith("Bearer")
    assert rows(server.url) == [run]  # no refused submission became a run
    assert api("GET", f"{server.url}/runs/{run}")[1]["status"] == "queued"  # not cancelled
    assert api("GET", f"{server.url}/healthz", token=None)[0] == 200

    # deja's own commands read the token themselves; --print-token says it for others
    listed = deja("runs", "--json")
    assert listed.returncode == 0, listed.stderr
    assert [r["run_id"] for r in json.loads(listed.stdout)["runs"]] == [run]
    printed = deja("serve", "--print-token")
    assert printed.returncode == 0 and printed.stdout.strip() == token
    other = deja("runs", env={"DEJA_HOME": str(tmp_path / "other-home")})
    assert other.returncode == 2 and "Unauthorized" in other.stderr
    assert "--print-token" in other.stderr


def test_a_foreign_host_is_misdirected_and_a_named_one_is_served(served: Served) -> None:
    port = served.url.rsplit(":", 1)[1]
    auth = {"authorization": f"Bearer {served.token}", "content-type": "application/json"}
    body = json.dumps({**RUN, "cwd": str(served.work)}).encode()
    before = served.rows()
    for host in ("rebind.attacker.example", f"rebind.attacker.example:{port}",
                 f"localhost.attacker.example:{port}", f"127.0.0.1.nip.io:{port}", "",
                 f"127.0.0.1:{port}@evil", f"[::2]:{port}", "10.1.2.3"):
        status, _, data = raw_request(served.url, "POST", "/runs", body,
                                      {**auth, "host": host})
        assert (status, named(data)) == (421, "MisdirectedRequest"), host
        assert "--allowed-host" in json.loads(data)["error"]["message"]
        status, _, _ = raw_request(served.url, "GET", "/healthz", None, {"host": host})
        assert status == 421, host
    assert served.rows() == before
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "LOCALHOST", "[::1]:1",
                 "127.0.0.2", f"deja.internal:{port}", "Deja.Internal"):
        status, _, data = raw_request(served.url, "GET", "/runs", None, {**auth, "host": host})
        assert status == 200, (host, data)


def test_a_browser_origin_other_than_the_servers_is_forbidden(served: Served) -> None:
    port = served.url.rsplit(":", 1)[1]
    auth = {"authorization": f"Bearer {served.token}", "content-type": "application/json"}
    body = json.dumps({**RUN, "cwd": str(served.work)}).encode()
    before = served.rows()
    for extra in ({"origin": "http://127.0.0.1:8501"}, {"origin": "http://localhost"},
                  {"origin": "null"}, {"origin": "https://attacker.example"},
                  {"origin": f"http://localhost:{port}"},  # another host name: another origin
                  {"sec-fetch-site": "cross-site"}, {"sec-fetch-site": "same-site"}):
        status, headers, data = raw_request(served.url, "POST", "/runs", body,
                                            {**auth, **extra})
        assert (status, named(data)) == (403, "ForeignOrigin"), extra
        assert not any(k.startswith("access-control-") for k in headers), headers
        assert headers["cross-origin-resource-policy"] == "same-origin"
    assert served.rows() == before
    same = {"origin": f"http://127.0.0.1:{port}", "sec-fetch-site": "same-origin"}
    status, _, data = raw_request(served.url, "POST", "/runs", body, {**auth, **same})
    assert status == 201, data
    status, headers, _ = raw_request(served.url, "OPTIONS", "/runs", None, {
        "origin": f"http://127.0.0.1:{port}", "access-control-request-method": "POST"})
    assert status == 405 and not any(k.startswith("access-control-") for k in headers)


def test_a_post_is_json_or_unsupported(served: Served) -> None:
    run = served.submit()
    auth = {"authorization": f"Bearer {served.token}"}
    body = json.dumps({**RUN, "cwd": str(served.work)}).encode()
    before = served.rows()
    for path, data in (("/runs", body), (f"/runs/{run}/input", b'{"answer": "yes"}'),
                       (f"/runs/{run}/cancel", b"{}"), (f"/runs/{run}/cancel", None)):
        for kind in (None, "text/plain", "text/plain;charset=UTF-8",
                     "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                     "application/json; charset=latin-1", "application/jsonp"):
            headers = {**auth, **({"content-type": kind} if kind else {})}
            status, _, answer = raw_request(served.url, "POST", path, data, headers)
            assert (status, named(answer)) == (415, "UnsupportedMediaType"), (path, kind)
            assert "application/json" in json.loads(answer)["error"]["message"]
    assert served.rows() == before
    assert served.api("GET", f"/runs/{run}")[1]["status"] == "queued"
    status, _, answer = raw_request(served.url, "POST", "/runs", body, {
        **auth, "content-type": "Application/JSON; charset=utf-8"})
    assert status == 201, answer


def test_bodies_no_database_can_hold_are_refused_before_anything_is_stored(
        served: Served) -> None:
    cwd = json.dumps(str(served.work))
    cases: list[tuple[bytes, str, str]] = [
        (b"[" * 100_000 + b"]" * 100_000, "BadJson", "100000 levels deep"),
        (b'{"command": ["python", ' + b"[" * 5000 + b"]" * 5000 + b"]}", "BadJson",
         "levels deep"),
        (b'{"command": ["python", "a.py\\u0000"], "cwd": ' + cwd.encode() + b"}", "BadJson",
         "NUL character at $.command[1]"),
        (b'{"command": ["python", "a.py"], "labels": {"t": "\\ud800"}}', "BadJson",
         "lone surrogate (U+D800) at $.labels.t"),
        (b'{"command": ["python", "a.py"], "labels": {"t\\udfff": "x"}}', "BadJson",
         "lone surrogate (U+DFFF) in a key"),
        ('{"command": ["python", "a.py"], "cwd": "/tmp/\ud800"}'.encode("utf-8",
                                                                         "surrogatepass"),
         "BadJson", "not UTF-8"),
        (b'{"command": ["python"], "guards": {"max_dollars": NaN}}', "BadJson", "NaN"),
        (b'{"command": ["python"], "guards": {"max_dollars": Infinity}}', "BadJson",
         "Infinity"),
        (b'{"command": ["python"], "command": ["rm", "-rf", "/"]}', "BadJson",
         "'command' twice"),
        (b'{"command": ["python", "a\x00.py"]}', "BadJson", "not JSON"),
        (b'{"command": ["python"], "guards": {"max_turns": ' + b"[" * 30 + b"]" * 30 + b"}}",
         "BadRunRequest", "must be a non-negative integer"),
    ]
    before = served.rows()
    for raw, kind, says in cases:
        status, body = served.api("POST", "/runs", raw=raw)
        assert (status, body["error"]["type"]) == (400, kind), (raw[:80], body)
        assert says in body["error"]["message"], (raw[:80], body)
        assert len(body["error"]["message"]) < 600, body
    assert served.rows() == before
    run = served.submit()
    for raw in (b'{"answer": "INV-7\\u0000"}', b'{"answer": "\\udbff"}',
                b"{" * 50_000 + b"}" * 50_000):
        status, body = served.api("POST", f"/runs/{run}/input", raw=raw)
        assert (status, body["error"]["type"]) == (400, "BadJson"), (raw[:40], body)
    for query in ("label=team%3D%00", "schedule=%ED%A0%80", "status=%ff"):
        status, body = served.api("GET", f"/runs?{query}")
        assert (status, body["error"]["type"]) == (400, "BadRunRequest"), (query, body)


def test_submitted_run_ids_cannot_take_a_part_or_an_occurrence(served: Served) -> None:
    assert served.submit(run_id="invoice-7") == "invoice-7"
    assert served.submit(run_id="invoice-7") == "invoice-7"  # the same id: one run
    before = served.rows()
    for taken, says in (("invoice-7.1", "no '.'"), ("r_01a2b3c4d5e6f7a8b9c0.2", "no '.'"),
                        ("s_weekly-report_20261207T050000Z", "schedule's occurrences"),
                        ("s_x", "schedule's occurrences"), ("-x", "run id"),
                        ("x" * 129, "run id"), ("a/b", "not a run id")):
        status, answer = served.api("POST", "/runs", {**RUN, "cwd": str(served.work),
                                                      "run_id": taken})
        assert (status, answer["error"]["type"]) == (400, "BadRunRequest"), (taken, answer)
        assert says in answer["error"]["message"], answer
    assert served.rows() == before


def read_events(served: Served, run: str, headers: dict[str, str] | None = None,
                query: str = "", stop_after: int | None = None,
                ) -> tuple[int, list[dict[str, Any]], http.client.HTTPConnection]:
    """``GET /runs/RUN/events``: its status and its events (id, event, data) until the
    stream ends or ``stop_after`` of them came; the connection, to drop it."""
    host, port = served.url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("GET", f"/runs/{run}/events{query}", headers={
        "authorization": f"Bearer {served.token}", **(headers or {})})
    response = conn.getresponse()
    events: list[dict[str, Any]] = []
    if response.status != 200:
        response.read()
        return response.status, events, conn
    event: dict[str, Any] = {}
    while stop_after is None or len(events) < stop_after:
        line = response.readline()
        if not line:
            break
        text = line.decode().rstrip("\n")
        if not text and event:
            events.append(event)
            event = {}
        elif text and not text.startswith(":"):
            field, _, value = text.partition(": ")
            event[field] = json.loads(value) if field == "data" else value
    return response.status, events, conn


def test_an_event_stream_resumes_where_it_dropped(served: Served) -> None:
    run = served.submit()
    status, first, conn = read_events(served, run, stop_after=1)
    conn.close()  # the stream drops after its first event
    assert status == 200 and first[0]["event"] == "status", first
    assert first[0]["data"]["status"] == "queued" and len(first[0]["id"]) == 16
    queued = first[0]["id"]

    # Resumed, the stream does not repeat what the client has: its first event is the
    # next change, here the cancel (sent once the stream is under way).
    host, port = served.url.removeprefix("http://").rsplit(":", 1)
    resumed = http.client.HTTPConnection(host, int(port), timeout=30)
    resumed.request("GET", f"/runs/{run}/events", headers={
        "authorization": f"Bearer {served.token}", "last-event-id": queued})
    response = resumed.getresponse()
    assert response.status == 200
    t0 = time.monotonic()
    assert served.api("POST", f"/runs/{run}/cancel", {})[0] == 200
    body = response.read().decode()  # to the end of the stream: the run has ended
    resumed.close()
    assert time.monotonic() - t0 < 20
    blocks = [b for b in body.split("\n\n") if b.strip() and not b.startswith(":")]
    assert len(blocks) == 1 and '"status": "cancelled"' in blocks[0], body
    cancelled = blocks[0].split("\n")[0].removeprefix("id: ")
    assert cancelled != queued and len(cancelled) == 16, blocks

    status, events, conn = read_events(served, run, query=f"?after={queued}")
    conn.close()
    assert status == 200 and [e["id"] for e in events] == [cancelled], events
    status, events, conn = read_events(served, run, {"last-event-id": cancelled})
    conn.close()
    assert status == 204 and events == []  # nothing more will come: EventSource stops
    status, events, conn = read_events(served, run)  # no cursor: from the start
    conn.close()
    assert [e["data"]["status"] for e in events] == ["cancelled"]


def test_the_token_is_made_once_and_kept_from_other_users(
        deja: Deja, tmp_path: Path) -> None:  # noqa: F811
    # A careless home: world-readable and traversable, so only the file's mode guards it.
    home = Path(tempfile.mkdtemp(prefix="deja-home-"))
    try:
        home.chmod(0o755)
        code = "from deja.runs.auth import ensure_token; print(ensure_token())"
        env = {**os.environ, "DEJA_HOME": str(home)}
        racers = [subprocess.Popen([sys.executable, "-c", code], env=env,
                                   stdout=subprocess.PIPE, text=True) for _ in range(4)]
        made = {racer.communicate(timeout=60)[0].strip() for racer in racers}
        assert len(made) == 1 and all(racer.returncode == 0 for racer in racers), made
        token = made.pop()
        assert sorted(p.name for p in home.iterdir()) == ["serve.token"]
        assert stat.S_IMODE((home / "serve.token").stat().st_mode) == 0o600
        server = deja.serve(env={"DEJA_HOME": str(home)})
        assert api("GET", f"{server.url}/runs", token=token)[0] == 200
        probe = (  # another user: read the token, else submit without it
            "import json, sys, urllib.request\n"
            "try:\n"
            f"    open({str(home / 'serve.token')!r}).read(); print('READ')\n"
            "except PermissionError:\n"
            "    print('denied')\n"
            f"r = urllib.request.Request({server.url + '/runs'!r}, method='POST', "
            "data=b'{\"command\": [\"id\"]}', headers={'content-type': 'application/json'})\n"
            "try:\n"
            "    urllib.request.urlopen(r, timeout=30); print('201')\n"
            "except urllib.error.HTTPError as e:\n"
            "    print(e.code)\n")
        if os.geteuid() == 0:  # as root the test can be that other user for real
            done = subprocess.run(["/usr/bin/python3", "-I", "-c", probe], user="nobody",
                                  group="nogroup", capture_output=True, text=True,
                                  timeout=60, cwd="/")
            assert done.stdout.split() == ["denied", "401"], (done.stdout, done.stderr)
        else:
            assert not os.access(home / "serve.token", os.R_OK) or \
                (home / "serve.token").stat().st_uid == os.geteuid()
        assert api("GET", f"{server.url}/runs", token=token)[1] == {"runs": []}
        (home / "serve.token").chmod(0o644)  # leaked: refused with the fix, not used
        shown = deja("runs", env={"DEJA_HOME": str(home)})
        assert shown.returncode == 2 and "can be read by others" in shown.stderr
        assert "Traceback" not in shown.stderr
    finally:
        for proc in deja.procs:
            proc.stop()
        shutil.rmtree(home)
