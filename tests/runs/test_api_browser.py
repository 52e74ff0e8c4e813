"""Web pages against ``deja serve``, in a real headless Chromium (Debian's
/usr/bin/chromium, driven by Playwright), with a real ``deja serve`` and a real ``deja
worker``.

A page of another origin (another port of 127.0.0.1, as any local dev server or a page
that a browser opened) tries everything a page can do without the user: a ``fetch``
with ``Content-Type: text/plain`` (which a browser sends without asking first), the same
as ``no-cors``, a JSON ``fetch`` (which needs a preflight), HTML forms with
``enctype="text/plain"`` posted by script to ``/runs`` and to a waiting run's
``/input``, and a read of ``GET /runs``. Every request reaches the server and is refused
there; the page reads none of the answers; no run is created and the waiting run is not
answered, while a worker is up and would run whatever were queued.

A page whose name was made to resolve to 127.0.0.1 (DNS rebinding: Chromium's host
resolver maps ``rebind.attacker.example``, the page itself is served by the test) calls
the API as its own origin, so the browser would let it read the answers: the server
refuses it for the ``Host`` it names. Chromium's own guard against this (Private Network
Access: a public page may not call loopback) is turned off there, as browsers without it
(and older Chromiums) would have it.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from playwright.sync_api import Page, Route, sync_playwright
from test_api import Deja, api, deja, watch  # noqa: F401 (the deja fixture)

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--host-resolver-rules=MAP rebind.attacker.example 127.0.0.1"]
WAIT_MS = 30_000

ATTACK = """<!doctype html>
<html><body>
<iframe name="sink1"></iframe><iframe name="sink2"></iframe>
<form id="submit-form" method="POST" action="%API%/runs" enctype="text/plain" target="sink1">
  <input name='{"command": ["touch", "%MARKER%"], "cwd": "%WORK%", "x": "' value='"}'>
</form>
<form id="answer-form" method="POST" action="%API%/runs/%RUN%/input" enctype="text/plain"
      target="sink2">
  <input name='{"answer": "INV-7: paid", "x": "' value='"}'>
</form>
<script>
const API = "%API%";
const cmd = JSON.stringify({command: ["touch", "%MARKER%"], cwd: "%WORK%"});
const out = {};
async function attempt(name, fn) {
  try { out[name] = await fn(); } catch (e) { out[name] = "blocked: " + e.name; }
}
async function read(r) { return "read " + r.status + " " + (await r.text()); }
async function opaque(r) {
  return "opaque " + r.type + " " + r.status + " [" + (await r.text()) + "]";
}
(async () => {
  await attempt("text_plain_submit", async () => read(await fetch(API + "/runs", {
    method: "POST", headers: {"Content-Type": "text/plain"}, body: cmd})));
  await attempt("no_cors_submit", async () => opaque(await fetch(API + "/runs", {
    method: "POST", mode: "no-cors", headers: {"Content-Type": "text/plain"}, body: cmd})));
  await attempt("json_submit", async () => read(await fetch(API + "/runs", {
    method: "POST", headers: {"Content-Type": "application/json"}, body: cmd})));
  await attempt("no_cors_answer", async () => opaque(await fetch(API + "/runs/%RUN%/input", {
    method: "POST", mode: "no-cors", headers: {"Content-Type": "text/plain"},
    body: JSON.stringify({answer: "INV-7: paid"})})));
  await attempt("no_cors_cancel", async () => opaque(await fetch(API + "/runs/%RUN%/cancel", {
    method: "POST", mode: "no-cors", body: "{}"})));
  await attempt("read_runs", async () => read(await fetch(API + "/runs")));
  await attempt("read_run", async () => read(await fetch(API + "/runs/%RUN%")));
  let loaded = 0;
  for (const name of ["sink1", "sink2"]) {
    document.querySelector(`iframe[name=${name}]`).addEventListener("load", () => {
      loaded += 1; if (loaded === 2) { window.results = out; }
    });
  }
  document.getElementById("submit-form").submit();
  document.getElementById("answer-form").submit();
})();
</script></body></html>
"""

REBOUND = """<!doctype html>
<html><body><script>
(async () => {
  const out = {};
  for (const [name, path, init] of [
      ["submit", "/runs", {method: "POST",
                           headers: {"Content-Type": "application/json"},
                           body: JSON.stringify({command: ["touch", "%MARKER%"], cwd: "%WORK%"})}],
      ["health", "/healthz", {}]]) {
    try {
      const r = await fetch(path, init);
      out[name] = r.status + " " + (await r.text());
    } catch (e) { out[name] = "blocked: " + e.name; }
  }
  window.results = out;
})();
</script></body></html>
"""


@contextmanager
def page_server(html: str) -> Iterator[str]:
    """A web page on another port of 127.0.0.1: another origin than the API's."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = html.encode()
            self.send_response(200)
            self.send_header("content-type", "text/html; charset=utf-8")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


NO_NETWORK_ACCESS_CHECKS = (
    "--disable-features=LocalNetworkAccessChecks,BlockInsecurePrivateNetworkRequests,"
    "PrivateNetworkAccessSendPreflights,PrivateNetworkAccessRespectPreflightResults")


@contextmanager
def chromium(*args: str) -> Iterator[Page]:
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                                    args=[*CHROMIUM_ARGS, *args])
        try:
            page = browser.new_page()
            page.set_default_timeout(WAIT_MS)
            yield page
        finally:
            browser.close()


def answered(log: str, method: str, path: str) -> list[str]:
    """The statuses ``deja serve`` logged for ``method path``."""
    return re.findall(rf"deja serve: {method} {re.escape(path)} (\S+) ", log)


def test_a_web_page_cannot_submit_answer_cancel_or_read_runs(deja: Deja) -> None:  # noqa: F811
    server = deja.serve()
    deja.worker("w1")
    submitted = deja("submit", "--", "python", "ask_agent.py")
    assert submitted.returncode == 0, submitted.stderr
    run = submitted.stdout.strip()
    waiting, _ = watch(server.url, run, lambda r: r["status"] == "input_required")
    marker = deja.tmp / "PWNED"
    html = (ATTACK.replace("%API%", server.url).replace("%RUN%", run)
            .replace("%MARKER%", str(marker)).replace("%WORK%", str(deja.work)))

    with page_server(html) as page_url, chromium() as page:
        page.goto(page_url)
        page.wait_for_function("window.results !== undefined")
        results = page.evaluate("window.results")

    # The page read nothing: a cross-origin answer without CORS headers is withheld, and
    # Cross-Origin-Resource-Policy withholds even the opaque answer of a no-cors request.
    assert results == dict.fromkeys((
        "text_plain_submit", "no_cors_submit", "json_submit", "no_cors_answer",
        "no_cors_cancel", "read_runs", "read_run"), "blocked: TypeError"), results
    # The server itself refused every request that reached it.
    log = server.log()
    assert answered(log, "POST", "/runs") == ["201", "403", "403", "403"], log  # deja submit
    assert answered(log, "OPTIONS", "/runs") == ["403"], log  # the JSON fetch's preflight
    assert answered(log, "POST", f"/runs/{run}/input") == ["403", "403"], log
    assert answered(log, "POST", f"/runs/{run}/cancel") == ["403"], log
    assert "403" in answered(log, "GET", "/runs") and "403" in answered(
        log, "GET", f"/runs/{run}"), log
    # Nothing was created, answered or cancelled, with a worker up the whole time.
    status, body = api("GET", f"{server.url}/runs")
    assert status == 200 and [r["run_id"] for r in body["runs"]] == [run], body
    record = api("GET", f"{server.url}/runs/{run}")[1]
    assert record["status"] == "input_required" and record["worker"] == "w1"
    assert record["question"] == waiting["question"] == "Ship the weekly report?"
    assert not marker.exists()


def test_a_rebound_page_is_refused_for_the_host_it_names(deja: Deja) -> None:  # noqa: F811
    server = deja.serve()
    port = server.url.rsplit(":", 1)[1]
    origin = f"http://rebind.attacker.example:{port}"
    marker = deja.tmp / "PWNED"
    html = REBOUND.replace("%MARKER%", str(marker)).replace("%WORK%", str(deja.work))

    def serve_page(route: Route) -> None:  # the attacker's own server, before the rebind
        route.fulfill(status=200, content_type="text/html", body=html)

    with chromium(NO_NETWORK_ACCESS_CHECKS) as page:
        page.route(f"{origin}/", serve_page)
        page.goto(f"{origin}/")
        page.wait_for_function("window.results !== undefined")
        results = page.evaluate("window.results")

    for name in ("submit", "health"):  # same origin, so the page reads the refusal
        status, _, text = results[name].partition(" ")
        assert status == "421" and json.loads(text)["error"]["type"] == \
            "MisdirectedRequest", results
    log = server.log()  # a browser sends a request answered 421 again, once
    assert set(answered(log, "POST", "/runs")) == {"421"}, log
    assert set(answered(log, "GET", "/healthz")) == {"421"}, log
    assert api("GET", f"{server.url}/runs")[1] == {"runs": []}
    assert not marker.exists()
