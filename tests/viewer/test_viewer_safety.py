"""A run's content never makes the viewer's page fetch anything, and only this machine's
own pages can talk to the viewer.

The hostile run is recorded the real way (the Anthropic SDK against the stub model):
Markdown images and HTML ``<img>`` tags that point at a canary HTTP server on 127.0.0.1
sit in the model's text, its thinking, the user's text, the system prompt, a tool's name
(closing the code span it is shown in), an image block's URL (the same), a tool's
arguments and result, a tool's error, a model error's message and the run's labels; a
``recorder.ask`` question waits on the Submitted runs page. ``deja view`` serves it and
headless Chromium opens every page and step: the canary must count no request, and the
text must be on the page as text. The same run through AppTest: no string the page
renders as Markdown holds an image, a link or HTML. The viewer's server is asked with a
foreign ``Host`` and ``Origin`` (plain HTTP, the websocket handshake, and Chromium with a
name resolved to 127.0.0.1, as DNS rebinding does): refused.
"""

from __future__ import annotations

import ast
import base64
import http.client
import json
import re
import socket
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import anthropic
import pytest
from markdown_it import MarkdownIt
from playwright.sync_api import Page, expect, sync_playwright
from streamlit.testing.v1 import AppTest
from test_viewer_browser import (
    CHROMIUM,
    CHROMIUM_ARGS,
    VIEWPORT,
    WAIT_MS,
    chromium_missing,
    open_page,
    serve_viewer,
)
from test_viewer_runs import wait_status, worker

import recorder
from deja.runs import config, engine
from deja.runs.service import Runs
from deja.runs.store import Store
from recorder.testing.server import StubServer
from viewer import submitted
from viewer.guard import allowed_hosts, host_name, refusal
from viewer.safe import code, escape, md, unescape

ROOT = Path(__file__).resolve().parents[2]
APP = ROOT / "viewer" / "app.py"
PNG = base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAC"
                       "hwGA60e6kgAAAABJRU5ErkJggg==")
MODEL = "claude-haiku-4-5"
# Places a run's text reaches the page; {leak} is a canary URL naming the place.
PLACES = ("model-text", "thinking", "user-text", "system", "tool-name", "image-url",
          "tool-args", "tool-result", "tool-error", "model-error", "label", "ask-question")


def bait(place: str, leak: str) -> str:
    """Markdown and HTML that fetch ``leak/<place>`` if rendered as markup."""
    url = f"{leak}/leak/{place}"
    return f"{place}: ![x]({url}.md) <img src=\"{url}.html\"> [link]({url}.link)"


def closing(place: str, leak: str) -> str:
    """A name that closes the code span it is shown in, then embeds an image."""
    return f"x` ![n]({leak}/leak/{place}.md) `"


# ---------------------------------------------------------------------- the canary


class Canary:
    """An HTTP server on 127.0.0.1 that remembers every request for a leak path."""

    def __init__(self) -> None:
        hits: list[str] = []

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.startswith("/leak/"):
                    hits.append(self.path)
                body = ATTACK_PAGE.encode() if self.path.startswith("/attack") else b"gif"
                self.send_response(200)
                self.send_header("Content-Type", "text/html" if self.path.startswith(
                    "/attack") else "image/gif")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.hits = hits
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Canary:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


# A page of another site: it tries the viewer's websocket and reports what happened.
ATTACK_PAGE = """<!doctype html><title>attack</title><script>
const ws = new WebSocket(new URLSearchParams(location.search).get("ws"), ["streamlit"]);
ws.onopen = () => { document.title = "opened"; };
ws.onerror = () => { document.title = "refused"; };
</script>"""


@pytest.fixture
def canary() -> Iterator[Canary]:
    with Canary() as server:
        yield server


# ---------------------------------------------------------------------- the hostile run


def record_hostile_run(folder: Path, leak: str) -> Path:
    """Record a run whose every text field baits the canary; returns its cassette."""
    tool_name = closing("tool-name", leak)
    script = {"turns": [
        {"thinking": bait("thinking", leak), "text": bait("model-text", leak),
         "tool_use": {"name": tool_name, "input": {"q": bait("tool-args", leak)}}},
        {"text": "done"},
        {"error": {"status": 400, "type": "invalid_request_error",
                   "message": bait("model-error", leak)}, "should_retry": False}]}

    @recorder.tool(name=tool_name)
    def lookup(q: str) -> str:
        return bait("tool-result", leak)

    @recorder.tool(name="failing")
    def failing() -> str:
        raise RuntimeError(bait("tool-error", leak))

    user = [{"type": "text", "text": bait("user-text", leak)},
            {"type": "image", "source": {"type": "url", "url": closing("image-url", leak)}},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(PNG).decode()}}]
    path = folder / "hostile.jsonl"
    with StubServer(script) as model, recorder.record(path, labels={"note": bait("label", leak)}), \
            anthropic.Anthropic(api_key="sk-stub", base_url=model.url) as client:
        ask: dict[str, Any] = {"model": MODEL, "max_tokens": 256,
                               "system": bait("system", leak)}
        messages: list[dict[str, Any]] = [{"role": "user", "content": user}]
        with client.messages.stream(**ask, messages=messages) as stream:
            reply = stream.get_final_message()
        [call] = [b for b in reply.content if b.type == "tool_use"]
        result = lookup(**call.input)
        with pytest.raises(RuntimeError):
            failing()
        messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                                       for b in reply.content]},
                     {"role": "user", "content": [{"type": "tool_result",
                                                   "tool_use_id": call.id, "content": result}]}]
        client.messages.create(**ask, messages=messages)
        with pytest.raises(anthropic.BadRequestError):
            client.messages.create(**ask, messages=[{"role": "user", "content": "again"}])
    return path


def run_id(path: Path) -> str:
    return str(json.loads(path.read_bytes().split(b"\n", 1)[0])["run"])


def steps(path: Path) -> int:
    return len(path.read_bytes().splitlines()) - 2  # the header and the end line


# ---------------------------------------------------------------------- the one helper


NASTY = ["![x](http://h/leak.png)", "<img src=http://h/leak>", "[l](http://h)", "<http://h/a>",
         "`code` ``x``", "**b** _i_ ~~s~~", "$x^2$ $$y$$", ":red[r] :material/home: :smile:",
         "a\n\n# heading\n- item\n1. one\n> quote\n```\nfence\n```\n[r]: http://h\n[r]",
         "&lt;img src=x&gt; &#60;b&#62;", "back\\slash \\![x](http://h)", "www.example.com",
         "x` ![n](http://h/leak) `", "``` ![n](http://h/leak) ```", "|a|b|\n|-|-|\n|1|2|",
         "line\r\nbreak\rthere", "ends with a backslash \\"]
PARSER = MarkdownIt("commonmark").enable(["table", "strikethrough"])


def markup(source: str) -> list[str]:
    """The tokens of ``source`` that would show more than text (or fetch something)."""
    found = []
    for token in PARSER.parse(source):
        for t in [token, *(token.children or [])]:
            if t.type in ("image", "link_open", "html_inline", "html_block", "fence",
                          "code_block", "heading_open", "bullet_list_open", "table_open",
                          "ordered_list_open", "blockquote_open", "em_open", "strong_open",
                          "s_open", "code_inline"):
                found.append(t.type)
    return found


def fetching(source: str) -> list[str]:
    """What in ``source`` would fetch or link something, or be HTML."""
    return [t for t in markup(source) if t in ("image", "link_open", "html_inline",
                                                "html_block")]


def plain(source: str) -> str:
    """The text ``source`` shows: its paragraphs' text, a blank line between them."""
    return "\n\n".join(
        "".join("\n" if t.type in ("softbreak", "hardbreak") else t.content
                for t in token.children or [])
        for token in PARSER.parse(source) if token.type == "inline")


def one_line(value: str) -> str:
    return re.sub(r"\r\n|[\r\n]", " ", value)


def lines(value: str) -> str:
    return re.sub(r"\r\n|\r", "\n", value)


@pytest.mark.parametrize("value", NASTY)
def test_md_shows_any_value_as_its_text(value: str) -> None:
    escaped = md("{}", value)
    assert markup(escaped) == [], escaped
    assert plain(escaped) == lines(value).strip(), escaped
    assert unescape(escaped) == lines(value)
    span = md("**tool call** {:code} · id {:code}", value, value)
    tokens = PARSER.parse(span)[1].children or []
    codes = [t.content for t in tokens if t.type == "code_inline"]
    assert codes == [one_line(value)] * 2, span
    assert not {t.type for t in tokens} & {"image", "link_open", "html_inline"}, span


def test_md_formats_numbers_and_keeps_its_own_markup() -> None:
    assert md("**{}** of {:,} steps · {:.2f}s", "run_1", 12345, 1.5) == \
        r"**run\_1** of 12\,345 steps · 1\.50s"
    assert md("{!r}", "a*b") == r"\'a\*b\'"
    assert code("plain") == "`plain`" and code("a`b") == "``a`b``"
    assert code("`edge`") == "`` `edge` ``" and escape("-1") == r"\-1"


def test_the_helper_in_a_streamlit_page(tmp_path: Path) -> None:
    """AppTest of a page that shows one value through each path: what Streamlit gets."""
    script = tmp_path / "page.py"
    script.write_text(
        "import streamlit as st\n"
        "from viewer.safe import md\n"
        "v = '![x](http://h/leak) <img src=http://h/leak>'\n"
        "st.markdown(md('**run** {:code} says {}', 'r`1', v))\n"
        "st.caption(md('{}', v))\n"
        "st.button(md('Open {}', v))\n"
        "st.text(v)\n")
    at = AppTest.from_file(str(script), default_timeout=30).run()
    assert not at.exception
    value = "![x](http://h/leak) <img src=http://h/leak>"
    for source in (at.markdown[0].value, at.caption[0].value, at.button[0].label):
        assert fetching(source) == [] and value in unescape(source), source
    assert at.markdown[0].value.startswith("**run** ``r`1`` says ")
    assert at.text[0].value == value


# ---------------------------------------------------------------------- the source rule


MARKDOWN_CALLS = {"markdown", "caption", "error", "warning", "info", "success", "title",
                  "header", "subheader", "toast", "expander", "button", "checkbox", "toggle",
                  "text_input", "text_area", "number_input", "selectbox", "multiselect",
                  "date_input", "metric", "radio", "tabs", "popover", "status", "write",
                  "link_button", "download_button", "page_link", "latex", "html"}
SAFE_FORMATTERS = {"money"}  # viewer functions that only ever return a formatted number


def safe_source(node: ast.expr) -> bool:
    """A string Streamlit renders as Markdown that is a literal, made by md(), or a number
    formatted here; and combinations of those."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str | int | float) or node.value is None
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        return node.func.id == "md" or node.func.id in SAFE_FORMATTERS
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return node.func.attr in SAFE_FORMATTERS
    if isinstance(node, ast.Name | ast.Attribute):  # a module's constant, written there
        return (node.id if isinstance(node, ast.Name) else node.attr).isupper()
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return safe_source(node.left) and safe_source(node.right)
    if isinstance(node, ast.IfExp):
        return safe_source(node.body) and safe_source(node.orelse)
    if isinstance(node, ast.JoinedStr):  # an f-string: every value a formatted number
        return all(isinstance(v, ast.Constant) or (
            isinstance(v, ast.FormattedValue) and v.format_spec is not None
            and _numeric(ast.unparse(v.format_spec))) for v in node.values)
    return False


def _numeric(spec: str) -> bool:
    """A format spec that a string refuses (``,`` or a number's type letter)."""
    spec = spec.removeprefix("f").strip("'\"")
    return "," in spec or spec[-1:] in tuple("bcdeEfFgGnoxX%")


def test_every_markdown_string_of_the_viewer_is_a_literal_or_made_by_md() -> None:
    """st.markdown and every other call that renders Markdown (captions, alerts, titles,
    widget labels and values, tooltips) gets a literal, or text made by viewer.safe.md."""
    bad = []
    for path in sorted((ROOT / "viewer").glob("*.py")):
        if path.name == "safe.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in MARKDOWN_CALLS):
                continue
            receiver = ast.unparse(node.func.value)
            if receiver in ("log", "logging", "st.session_state", "st.column_config") \
                    or receiver.startswith(("log.", "self.")):
                continue
            args = node.args[:2] if node.func.attr == "metric" else node.args[:1]
            named = ("label", "body", "help", *(("value", "delta") if
                                                 node.func.attr == "metric" else ()))
            args += [k.value for k in node.keywords if k.arg in named]
            bad += [f"{path.name}:{node.lineno}: {ast.unparse(a)}" for a in args
                    if not safe_source(a)]
    assert bad == [], "Markdown made from a value without md():\n" + "\n".join(bad)


def test_the_guard_lets_through_only_the_viewers_own_names_and_pages() -> None:
    hosts = allowed_hosts(["viewer.example"])
    for host in ("127.0.0.1:8501", "localhost:8501", "[::1]:8501", "LOCALHOST.", "viewer.example"):
        assert refusal({"host": host}, hosts) is None, host
        assert refusal({"host": host, "origin": f"http://{host}"}, hosts) is None, host
    assert refusal({"host": "viewer.example", "origin": "https://viewer.example"}, hosts) is None
    for host in (None, "", "rebind.attacker.example:8501", "127.0.0.1.attacker.example",
                 "a@127.0.0.1", "127.0.0.1:port", "127.0.0.1/x"):
        assert refusal({"host": host} if host is not None else {}, hosts) is not None, host
    for origin in ("null", "http://127.0.0.1:8502", "http://rebind.attacker.example:8501",
                   "file://", "http://localhost:8501"):
        refused = refusal({"host": "127.0.0.1:8501", "origin": origin}, hosts)
        assert refused is not None and refused[0] == 403, origin
    assert refusal({"host": "127.0.0.1:1", "sec-fetch-site": "cross-site",
                    "sec-fetch-mode": "no-cors"}, hosts) == (
        403, "deja view does not serve its content to other sites' pages")
    assert refusal({"host": "127.0.0.1:1", "sec-fetch-site": "cross-site",
                    "sec-fetch-mode": "navigate"}, hosts) is None  # a link from elsewhere
    assert host_name("[::1]:80") == "::1" and host_name("h:port") is None


# ---------------------------------------------------------------------- the run, in AppTest


def rendered_markdown(at: AppTest) -> list[str]:
    """Every string of the page that Streamlit renders as Markdown."""
    out = [str(e.value) for kind in ("markdown", "caption", "error", "warning", "info",
                                     "success", "title", "header", "subheader")
           for e in getattr(at, kind)]
    out += [str(e.label) for kind in ("expander", "button", "checkbox", "toggle",
                                      "selectbox", "multiselect", "text_input", "metric")
            for e in getattr(at, kind)]
    out += [str(m.value) for m in at.metric]
    return out


def page_text(at: AppTest) -> str:
    """What the page shows, as text: plain text and code verbatim, Markdown as it reads."""
    return "\n".join([*(str(t.value) for t in at.text), *(str(c.value) for c in at.code),
                      *(unescape(s) for s in rendered_markdown(at)),
                      *(str(j.proto.body) for j in at.json)])


def test_every_step_of_a_hostile_run_renders_no_markup(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    leak = "http://127.0.0.1:9"
    path = record_hostile_run(tmp_path, leak)
    monkeypatch.setenv("DEJA_VIEW_DIR", str(tmp_path))
    shown: list[str] = []
    for step in [None, *range(steps(path))]:
        at = AppTest.from_file(str(APP), default_timeout=30)
        at.query_params.update(run=run_id(path), **({} if step is None else {"step": step}))
        at.run()
        assert not at.exception, [e.value for e in at.exception]
        for source in rendered_markdown(at):
            assert fetching(source) == [], (step, source)
        shown.append(page_text(at))
    text = "\n".join(shown)
    for place in ("model-text", "thinking", "user-text", "system", "tool-result",
                  "tool-error", "model-error"):
        assert bait(place, leak) in text, place
    assert closing("tool-name", leak) in text and closing("image-url", leak) in text


# ---------------------------------------------------------------------- in a real browser


REBIND = "rebind.attacker.example"  # an attacker's name, made to resolve to 127.0.0.1
ASK_AGENT = '''
import sys
import recorder

recorder.ask(sys.argv[1])
'''


@contextmanager
def browser(*args: str) -> Iterator[Page]:
    """A page of a fresh headless Chromium started with ``args`` too."""
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                                     args=[*CHROMIUM_ARGS, *args])
        try:
            page = chromium.new_page(viewport=VIEWPORT)
            page.set_default_timeout(WAIT_MS)
            expect.set_options(timeout=WAIT_MS)
            yield page
        finally:
            chromium.close()


def settled(page: Page, canary: Canary) -> None:
    """Streamlit done drawing, then every expander open and the network quiet: by then
    the page has asked for every image it shows, and the canary must have had no request."""
    for _ in range(2):
        page.wait_for_load_state("networkidle")
        expect(page.get_by_test_id("stStatusWidget")).to_have_count(0)
        for summary in page.get_by_test_id("stExpander").locator("summary").all():
            if not summary.evaluate("s => s.parentElement.open"):
                summary.click()
    page.wait_for_load_state("networkidle")
    assert canary.hits == [], f"{page.url} made the browser fetch {canary.hits}"


def visible(page: Page, text: str) -> None:
    expect(page.get_by_text(text, exact=False).filter(visible=True).first).to_be_visible()


def handshake(port: int, host: str, origin: str | None = None, cookie: str | None = None) -> str:
    """The status line the viewer answers a websocket handshake with."""
    request = (f"GET /_stcore/stream HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\n"
               "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
               "Sec-WebSocket-Version: 13\r\nSec-WebSocket-Protocol: streamlit\r\n"
               + (f"Origin: {origin}\r\n" if origin else "")
               + (f"Cookie: {cookie}\r\n" if cookie else "") + "\r\n")
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request.encode())
        return sock.recv(4096).split(b"\r\n", 1)[0].decode()


def http_get(port: int, path: str, **headers: str) -> tuple[int, bytes, dict[str, str]]:
    """Status, body and headers (lowercase names) of ``GET path`` with ``headers``."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path, headers=headers)
        response = conn.getresponse()
        return response.status, response.read(), {k.lower(): v for k, v in
                                                   response.getheaders()}
    finally:
        conn.close()


def refuses_other_sites(page: Page, port: int, canary: Canary) -> None:
    """Another Host or Origin: refused over HTTP, at the websocket, and in Chromium, where
    the attacker's name resolves to 127.0.0.1 as DNS rebinding makes it."""
    own = f"127.0.0.1:{port}"
    signed = "; ".join(f"{c['name']}={c['value']}" for c in page.context.cookies(f"http://{own}"))
    for path in ("/", "/_stcore/health", "/media/x.png"):
        status, body, _ = http_get(port, path, Host=f"{REBIND}:{port}")
        assert status == 421 and b"--allow-host" in body, (path, status, body)
    assert http_get(port, "/_stcore/health", Host=f"localhost:{port}")[0] == 200
    assert http_get(port, "/_stcore/health", Host=own, Origin=f"http://{REBIND}:{port}")[0] == 403
    assert http_get(port, "/_stcore/health", Host=own, **{
        "Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors"})[0] == 403
    status, _, headers = http_get(port, "/", Host=own, Cookie=signed)  # images: its own
    assert status == 200 and headers["content-security-policy"] == \
        "img-src 'self' data: blob:; frame-ancestors 'none'"
    # The websocket: a foreign Host, a foreign Origin, then the viewer's own page.
    # (with the viewer's cookie: these are refused for their Host or Origin alone)
    assert " 101 " not in handshake(port, f"{REBIND}:{port}", f"http://{REBIND}:{port}", signed)
    assert " 101 " not in handshake(port, f"{REBIND}:{port}", cookie=signed)
    assert " 101 " not in handshake(port, own, canary.url, signed)
    assert " 101 " not in handshake(port, own, "null", signed)
    assert " 101 " in handshake(port, own, f"http://{own}", signed)
    response = page.goto(f"http://{REBIND}:{port}/")
    assert response is not None and response.status == 421
    expect(page.get_by_test_id("stApp")).to_have_count(0)
    visible(page, "deja view answers only on this machine's own names")
    # Pages of another site try the viewer's websocket, by its address and by the name.
    canary_port = canary.url.rsplit(":", 1)[1]
    for target in (own, f"{REBIND}:{port}"):
        page.goto(f"http://{REBIND}:{canary_port}/attack?ws=ws://{target}/_stcore/stream")
        expect(page).to_have_title("refused")


def test_the_viewer_in_chromium_fetches_nothing_a_run_names_and_answers_only_itself(
        tmp_path: Path, canary: Canary) -> None:
    missing = chromium_missing()
    if missing:
        pytest.fail(missing)
    folder = tmp_path / "cassettes"
    folder.mkdir()
    path = record_hostile_run(folder, canary.url)
    rid, question = run_id(path), bait("ask-question", canary.url)
    project = tmp_path / "project"
    project.mkdir()
    (project / "ask_agent.py").write_text(ASK_AGENT)
    url = config.database_url()
    service = Runs(Store(url), engine.Client(url))
    log = tmp_path / "worker.log"
    try:
        with worker(log), serve_viewer(folder, tmp_path / "view.log") as base, \
                browser(f"--host-resolver-rules=MAP {REBIND} 127.0.0.1") as page:
            asked = service.submit({"command": [sys.executable, "ask_agent.py", question],
                                    "cwd": str(project),
                                    "labels": {"note": bait("label", canary.url)}})["run_id"]
            # The runs page: labels in the table, tool names among the filters.
            open_page(page, base + "/")
            visible(page, "1 run(s)")
            page.get_by_role("combobox", name="Tool used").click()
            expect(page.get_by_role("option").first).to_be_visible()
            settled(page, canary)
            # Each step of the run (under the run's totals, timeline and charts), with
            # every expander open: what everyone said reads as it was said.
            shown = {0: ("model-text", "thinking", "user-text", "system"), 1: ("tool-result",),
                     2: ("tool-error",), steps(path) - 1: ("model-error",)}
            for step in range(steps(path)):
                open_page(page, f"{base}/?run={rid}&file={path.name}&step={step}")
                visible(page, f"Step {step}:")
                settled(page, canary)
                for place in shown.get(step, ()):
                    visible(page, bait(place, canary.url))
                if step == 0:
                    visible(page, f"Run {rid}")
                    visible(page, closing("image-url", canary.url))
                    visible(page, closing("tool-name", canary.url))
                    expect(page.get_by_test_id("stImage")).to_have_count(1)  # from its bytes
            # The question of a waiting run, on the Submitted runs page.
            wait_status(service, asked, "input_required", log)
            open_page(page, base + "/?page=submitted")
            visible(page, question)
            settled(page, canary)
            refuses_other_sites(page, int(base.rsplit(":", 1)[1]), canary)
    finally:
        submitted.close(service)
    assert canary.hits == []
