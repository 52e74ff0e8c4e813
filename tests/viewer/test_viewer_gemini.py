"""The viewer reads a Gemini step as it reads an Anthropic one, through the conversation:
its function calls and responses are tool blocks (the response named by its function), the
step page draws them as tool calls and results, and the search finds what the step says:
its prompt, the function called with its arguments, the function's response and the
reply. One run recorded with the real google-genai SDK against the stub server."""

from __future__ import annotations

from pathlib import Path

import pytest
from gemini_helpers import function_config, function_loop
from streamlit.testing.v1 import AppTest

import recorder
from recorder.cassette import load
from recorder.testing.server import StubServer
from viewer import queries
from viewer.content import searchable_text
from viewer.index import RunIndex

KEY = "test-key-0123456789abcdef"  # conftest's key: the run verifies in every test
APP = Path(__file__).resolve().parents[2] / "viewer" / "app.py"
PROMPT = "What is the weather in Reykjavik?"
SYSTEM = "Answer in one sentence."
LOOKING, ANSWER = "Let me look.", "Snowing in Reykjavik, minus three."
SCRIPT = {"select": "conversation", "turns": [
    {"text": LOOKING, "tool_use": {"name": "get_weather", "input": {"city": "Reykjavik"}}},
    {"text": ANSWER}]}
CONFIG = function_config("get_weather", "city", "The weather in a city today.",
                         system_instruction=SYSTEM)
FORECAST = {"forecast": "heavy snow", "celsius": -3}


def agent(url: str) -> None:
    function_loop(url, "AIzaSyD-deja-viewer-0123456789abcdefgh", PROMPT, CONFIG,
                  lambda call: FORECAST)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("gemini-runs")
    path = folder / "gemini.jsonl"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEJA_KEY", KEY)
        mp.setenv("DEJA_HOME", str(tmp_path_factory.mktemp("gemini-home")))
        with StubServer(SCRIPT) as server, recorder.record(path):
            agent(server.url)
        assert [o["kind"] for o in load(path)] == ["model", "model"]
    return path



def test_a_gemini_step_reads_as_tool_blocks_and_is_found_by_what_it_says(run: Path) -> None:
    first = queries.step_detail(run, 0).conversation
    assert first is not None
    assert first["system"] == [{"type": "text", "text": SYSTEM}]
    reply = first["response"]
    assert [b["type"] for b in reply["blocks"]] == ["text", "tool_use"]
    call = reply["blocks"][1]
    assert (call["name"], call["input"]) == ("get_weather", {"city": "Reykjavik"})

    second = queries.step_detail(run, 1).conversation
    assert second is not None
    assert [(m["role"], m["new"]) for m in second["turns"]] == [
        ("user", False), ("assistant", True), ("user", True)]
    [result] = second["turns"][2]["blocks"]
    assert (result["type"], result["tool_use_id"], result["name"]) == \
        ("tool_result", call["id"], "get_weather")
    assert [b["raw"] for b in result["blocks"]] == [FORECAST]
    assert second["response"]["blocks"] == [{"type": "text", "text": ANSWER}]

    # the search reads the same conversation: the prompt, the call, the response, the reply
    one, two = load(run)
    assert PROMPT in searchable_text(one) and SYSTEM in searchable_text(one)
    assert LOOKING in searchable_text(one) and "get_weather" in searchable_text(one)
    assert "Reykjavik" in searchable_text(one)  # the call's arguments
    words = searchable_text(two)  # what the second request adds, and its reply
    assert "heavy snow" in words and ANSWER in words and PROMPT not in words


def test_the_step_page_draws_the_call_and_response_and_the_search_finds_the_run(
        run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with RunIndex(run.parent) as idx:
        idx.refresh()
        assert len(queries.list_runs(idx, text="heavy SNOW")) == 1
        assert len(queries.list_runs(idx, text="Reykjavik")) == 1
    monkeypatch.setenv("DEJA_VIEW_DIR", str(run.parent))
    at = AppTest.from_file(str(APP), default_timeout=30)
    at.query_params.update(run=load(run).run, step="1")
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    markdown = [str(m.value) for m in at.markdown]
    assert any("tool call** `get_weather`" in m for m in markdown), markdown
    assert any("tool result** of `get_weather`" in m for m in markdown), markdown
    assert ANSWER in [str(t.value) for t in at.text]
