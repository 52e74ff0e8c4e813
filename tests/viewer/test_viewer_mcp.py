"""MCP steps in the viewer and in ``deja diff``: a call to an MCP server's tool names the
server (its name and version, its transport and command or URL), the method and tool,
its arguments and result, and what the server sent before its answer, in order (progress,
log messages, a request of the client's with the client's answer); another MCP request
reads as its method and params. Two runs whose calls differ in an argument, or went to
another server, say so field by field.

The runs are the MCP tests' agents against the ledger server, real processes over stdio
and Streamable HTTP; the pages are driven with streamlit's AppTest, and one in headless
Chromium (``deja view`` served for real).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import expect
from streamlit.testing.v1 import AppTest
from test_viewer_browser import chromium_missing, chromium_page, open_page, serve_viewer, shot

import recorder
from recorder.cassette import load
from replayer.diff import compare, render
from viewer.safe import unescape

ROOT = Path(__file__).resolve().parents[2]
APP = ROOT / "viewer" / "app.py"


def _helpers() -> Any:
    """The MCP tests' helpers (``tests/mcp/mcp_helpers.py``), loaded by path."""
    name = "deja_viewer_mcp_helpers"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "tests" / "mcp" /
                                                      "mcp_helpers.py")
        assert spec is not None and spec.loader is not None
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


helpers = _helpers()


def record(path: Path, agent: str) -> str:
    with recorder.record(path):
        helpers.load_agent(agent).main()
    return load(path).run


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory, module_env: dict[str, str]) -> Path:
    """A folder of runs, recorded once for the module: ``a``, the SDK agent; ``b``, the same
    for order B-2; ``c``, the same over HTTP; ``ask``, the agent whose server asks it to
    sample and to confirm."""
    top = tmp_path_factory.mktemp("mcp-viewer")
    folder, ledger = top / "runs", helpers.Ledger(top / "bin", top / "ledger.db")
    folder.mkdir()
    ledger.bin.mkdir()
    ledger.install()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(io.StringIO()):
        for name, value in module_env.items():
            mp.setenv(name, value)
        mp.setenv("PATH", f"{ledger.bin}{os.pathsep}{os.environ['PATH']}")
        mp.setenv("LEDGER_DB", str(ledger.db))
        record(folder / "a.jsonl", "sdk_agent")
        mp.setenv("LEDGER_ORDER", "B-2")
        record(folder / "b.jsonl", "sdk_agent")
        mp.delenv("LEDGER_ORDER")
        record(folder / "ask.jsonl", "callbacks_agent")
        server, port = helpers.serve("--http")
        try:
            mp.setenv("LEDGER_URL", f"http://127.0.0.1:{port}/mcp")
            record(folder / "c.jsonl", "sdk_agent")
        finally:
            helpers.stop(server)
    return folder


@pytest.fixture
def runs(corpus: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The corpus's runs by name, their ids; the viewer looks at the corpus."""
    monkeypatch.setenv("DEJA_VIEW_DIR", str(corpus))
    return {p.stem: load(p).run for p in corpus.glob("*.jsonl")}


def page(**params: str) -> AppTest:
    at = AppTest.from_file(str(APP), default_timeout=30)
    at.query_params.update(params)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def captions(at: AppTest) -> str:
    return "\n".join(unescape(str(c.value)) for c in at.caption)


def seq(run: str, name: str) -> str:
    """The step of the tool ``name``, or of the MCP request of that method, in ``run``."""
    path = Path(os.environ["DEJA_VIEW_DIR"]) / f"{run}.jsonl"
    return str(helpers.seq_of(path, "mcp" if "/" in name else "tool", name))


def test_an_mcp_step_shows_its_server_call_and_exchange(runs: dict[str, str]) -> None:
    at = page(run=runs["a"], step=seq("a", "refund"))
    said = captions(at)
    assert "MCP server ledger 1.4.2 (stdio: ledger-server)" in said
    assert "tools/call of tool refund (destructive)" in said
    assert ("before its answer the server sent: notifications/progress, "
            "notifications/message, notifications/progress") in said
    assert any("**tool** `refund`" in str(m.value) for m in at.markdown)
    shown = [j.value for j in at.json]
    assert any('"amount": 40' in v and '"order": "A-1"' in v for v in shown)  # arguments
    assert any("refunded 40.00 EUR on A-1" in v for v in shown)  # the CallToolResult

    over_http = captions(page(run=runs["c"], step=seq("c", "lookup")))
    assert "MCP server ledger 1.4.2 (http: http://127.0.0.1:" in over_http
    assert "tools/call of tool lookup" in over_http
    assert "lookup (destructive)" not in over_http  # read-only

    prompt = page(run=runs["a"], step=seq("a", "prompts/get"))
    assert any("**mcp** `prompts/get`" in str(m.value) for m in prompt.markdown)
    assert any('"name": "apology"' in j.value for j in prompt.json)
    assert "1.4.2 (stdio: ledger-server) · prompts/get" in captions(prompt)

    asked = captions(page(run=runs["ask"], step=seq("ask", "summarize")))
    assert "before its answer the server sent: sampling/createMessage (the client " \
        "answered)" in asked


def server_table(at: AppTest) -> dict[str, str]:
    [table] = [d.value for d in at.dataframe if "value" in d.value.columns]
    return dict(zip(table[""], table["value"], strict=True))


def exchange(at: AppTest) -> list[str]:
    """What the exchange panel says, in order: each message's line, its params and any
    answer (as the JSON shown)."""
    [panel] = [e for e in at.expander if "before its answer" in unescape(str(e.label))]
    return [unescape(str(x.value)) for x in panel.children.values()
            if x.type in ("markdown", "json", "caption")]


def test_an_mcp_steps_server_and_exchange_are_drawn_in_order(runs: dict[str, str]) -> None:
    at = page(run=runs["a"], step=seq("a", "refund"))
    assert server_table(at) == {"name": "ledger", "version": "1.4.2", "transport": "stdio",
                                "command": "ledger-server", "method": "tools/call",
                                "tool": "refund", "destructive": "yes"}
    said = exchange(at)
    lines = [line for line in said if line.startswith("**")]
    assert lines == ["**1** · notification `notifications/progress`",
                     "**2** · notification `notifications/message`",
                     "**3** · notification `notifications/progress`"]
    assert said[1].startswith("{") and '"progress"' in said[1]  # the params, after its line

    over_http = server_table(page(run=runs["c"], step=seq("c", "lookup")))
    assert over_http["transport"] == "http" and over_http["url"].startswith("http://127.0.0.1:")
    assert over_http["destructive"] == "no" and "command" not in over_http

    asked = exchange(page(run=runs["ask"], step=seq("ask", "summarize")))
    at_request = asked.index("**1** · request of the client `sampling/createMessage`")
    assert '"messages"' in asked[at_request + 1]  # what the server asked
    assert asked[at_request + 2] == "the client's answer"
    assert '"role": "assistant"' in asked[at_request + 3]  # what the client answered
    listed = server_table(page(run=runs["a"], step=seq("a", "prompts/get")))
    assert listed["method"] == "prompts/get" and "tool" not in listed


def test_deja_diff_and_the_viewer_show_an_argument_or_a_server_changed(
        runs: dict[str, str]) -> None:
    folder = Path(os.environ["DEJA_VIEW_DIR"])
    text = render(compare(load(folder / "a.jsonl"), load(folder / "b.jsonl"),
                          align="meaning"))
    assert '/args/order: "A-1" -> "B-2"' in text
    assert '/params/arguments/order: "A-1" -> "B-2"' in text  # the prompt's request
    moved = render(compare(load(folder / "a.jsonl"), load(folder / "c.jsonl"),
                           align="meaning"))
    assert '/mcp/server/transport: "stdio" -> "http"' in moved
    assert '/mcp/server/url: (absent) -> "/mcp"' in moved

    at = page(a=runs["a"], a_file="a.jsonl", b=runs["b"], b_file="b.jsonl")
    tables = [d.value for d in at.dataframe if "field" in d.value.columns]
    rows = {(r["field"], r["A"], r["B"]) for t in tables for r in t.to_dict("records")}
    assert ("/args/order", "A-1", "B-2") in rows
    other = page(a=runs["a"], a_file="a.jsonl", b=runs["c"], b_file="c.jsonl")
    tables = [d.value for d in other.dataframe if "field" in d.value.columns]
    assert ("/mcp/server/transport", "stdio", "http") in {
        (r["field"], r["A"], r["B"]) for t in tables for r in t.to_dict("records")}


def test_an_mcp_step_in_chromium(runs: dict[str, str], tmp_path: Path) -> None:
    missing = chromium_missing()
    if missing:
        pytest.fail(missing)
    folder = Path(os.environ["DEJA_VIEW_DIR"])
    with serve_viewer(folder, tmp_path / "view.log") as base, chromium_page() as browser:
        open_page(browser, f"{base}/?run={runs['ask']}&step={seq('ask', 'confirm')}")
        app = browser.get_by_test_id("stApp")
        for words in ("MCP server ledger 1.4.2 (stdio: ledger-server)",
                      "tools/call of tool confirm (destructive)",
                      "elicitation/create (the client answered)", "A-1: approved",
                      "What the server sent before its answer (1)",
                      "request of the client", "the client's answer"):
            app.get_by_text(words, exact=False).first.wait_for()
        table = browser.get_by_test_id("stDataFrame").last.locator("table")
        expect(table).to_contain_text("ledger-server")
        expect(table).to_contain_text("destructive")
        app.get_by_text("MCP server and call").scroll_into_view_if_needed()
        shot(browser, tmp_path / "mcp-step.png")
