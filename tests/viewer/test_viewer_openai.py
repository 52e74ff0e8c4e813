"""The viewer reads OpenAI calls as conversations, as it reads Anthropic ones.

One run recorded with the real openai SDK against the stub server: a Chat Completions
tool loop (system prompt, a user message with an image, the assistant's ``tool_calls``,
the ``role: tool`` result), a streamed chat completion, and a Responses tool loop
(``instructions``, ``input`` items with the echoed ``function_call`` and its
``function_call_output``), the last call streamed. Each step opens as who said what, tool
calls with parsed arguments, tool results named by their tool, and the reply.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import openai
import pytest
from streamlit.testing.v1 import AppTest

import recorder
from recorder.cassette import load
from recorder.testing.server import StubServer
from viewer import queries
from viewer.content import searchable_text
from viewer.index import RunIndex
from viewer.safe import unescape

MODEL = "gpt-4.1"  # a model the openai SDK knows and does not warn about
KEY = "test-key-0123456789abcdef"  # conftest's key: the run verifies in every test
APP = Path(__file__).resolve().parents[2] / "viewer" / "app.py"
PNG_B64 = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJ"
           "RU5ErkJggg==")
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}},
              "required": ["city"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": PARAMETERS}}]
RESPONSE_TOOLS = [{"type": "function", "name": "weather", "parameters": PARAMETERS}]
SYSTEM = "You are a travel helper."
QUESTION = "What is the weather in 東京?"
LOOKING, ANSWER = "Let me look that up for you.", "Sunny in 東京 today."
SCRIPT = {"select": "conversation", "turns": [
    {"text": LOOKING, "tool_use": {"name": "weather", "input": {"city": "東京"}},
     "usage": {"input_tokens": 120, "output_tokens": 9, "cache_read_input_tokens": 300}},
    {"text": ANSWER, "usage": {"input_tokens": 40, "output_tokens": 6}}]}


@recorder.tool
def weather(city: str) -> str:
    return f"{city}: sunny, 22°C"


def agent(url: str) -> None:
    with openai.OpenAI(base_url=f"{url}/v1", api_key="sk-test", max_retries=0) as c:
        image = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG_B64}"}}
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": [{"type": "text", "text": QUESTION}, image]}]
        first = c.chat.completions.create(model=MODEL, messages=messages, tools=CHAT_TOOLS)
        message = first.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        messages += [{"role": "tool", "tool_call_id": call.id,
                      "content": weather(**json.loads(call.function.arguments))}
                     for call in message.tool_calls or []]
        c.chat.completions.create(model=MODEL, messages=messages, tools=CHAT_TOOLS)
        with c.chat.completions.stream(model=MODEL, messages=messages[:2],
                                       stream_options={"include_usage": True}) as s:
            s.get_final_completion()

        items: list[Any] = [{"role": "developer", "content": "Answer in one line."},
                            {"role": "user", "content": QUESTION}]
        response = c.responses.create(model=MODEL, instructions=SYSTEM, input=items,
                                      tools=RESPONSE_TOOLS)
        items += [item.model_dump(exclude_none=True) for item in response.output]
        items += [{"type": "function_call_output", "call_id": item.call_id,
                   "output": weather(**json.loads(item.arguments))}
                  for item in response.output if item.type == "function_call"]
        with c.responses.stream(model=MODEL, instructions=SYSTEM, input=items,
                                tools=RESPONSE_TOOLS) as s:
            s.get_final_response()


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("openai-runs")
    path = folder / "openai.jsonl"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEJA_KEY", KEY)
        mp.setenv("DEJA_HOME", str(tmp_path_factory.mktemp("openai-home")))
        with StubServer(SCRIPT) as server, recorder.record(path):
            agent(server.url)
        kinds = [o["kind"] for o in load(path)]
    assert kinds == ["model", "tool", "model", "model", "model", "tool", "model"], kinds
    return path


def roles(conv: dict[str, Any]) -> list[str]:
    return [m["role"] for m in conv["turns"]]


def test_a_chat_tool_call_and_its_result_read_as_a_conversation(run: Path) -> None:
    first = queries.step_detail(run, 0).conversation
    assert first is not None
    assert first["system"] == [{"type": "text", "text": SYSTEM}]  # lifted from messages
    assert roles(first) == ["user"] and first["turns"][0]["new"]
    text, image = first["turns"][0]["blocks"]
    assert text == {"type": "text", "text": QUESTION}
    assert image["type"] == "image" and image["data"] == base64.b64decode(PNG_B64)
    assert image["media_type"] == "image/png"
    reply = first["response"]
    assert [b["type"] for b in reply["blocks"]] == ["text", "tool_use"]
    assert reply["blocks"][0]["text"] == LOOKING
    call = reply["blocks"][1]
    assert (call["name"], call["input"]) == ("weather", {"city": "東京"})  # parsed arguments
    assert call["id"].startswith("call_")
    assert reply["stop_reason"] == "tool_calls" and not reply["streamed"]
    # usage in deja's names: the cached prompt tokens apart
    assert reply["usage"] == {"input_tokens": 120, "output_tokens": 9,
                              "cache_read_input_tokens": 300}

    second = queries.step_detail(run, 2).conversation
    assert second is not None
    assert roles(second) == ["user", "assistant", "tool"]
    assert [m["new"] for m in second["turns"]] == [False, True, True]
    echoed = second["turns"][1]["blocks"]
    assert [b["type"] for b in echoed] == ["text", "tool_use"] and echoed[1]["id"] == call["id"]
    [result] = second["turns"][2]["blocks"]
    assert result["type"] == "tool_result" and result["tool_use_id"] == call["id"]
    assert result["name"] == "weather"
    assert result["blocks"] == [{"type": "text", "text": "東京: sunny, 22°C"}]
    assert second["response"]["blocks"] == [{"type": "text", "text": ANSWER}]
    assert second["response"]["stop_reason"] == "stop"

    streamed = queries.step_detail(run, 3).conversation
    assert streamed is not None and streamed["response"]["streamed"]
    assert [b["type"] for b in streamed["response"]["blocks"]] == ["text", "tool_use"]
    assert streamed["response"]["blocks"][1]["input"] == {"city": "東京"}


def test_a_responses_tool_loop_reads_as_a_conversation(run: Path) -> None:
    first = queries.step_detail(run, 4).conversation
    assert first is not None
    assert first["system"] == [{"type": "text", "text": SYSTEM}]  # the instructions
    assert roles(first) == ["developer", "user"]
    assert first["turns"][0]["blocks"] == [{"type": "text", "text": "Answer in one line."}]
    reply = first["response"]
    assert [b["type"] for b in reply["blocks"]] == ["text", "tool_use"]
    assert reply["blocks"][0]["text"] == LOOKING
    call = reply["blocks"][1]
    assert (call["name"], call["input"]) == ("weather", {"city": "東京"})
    assert reply["stop_reason"] == "completed" and not reply["streamed"]
    assert reply["usage"]["cache_read_input_tokens"] == 300

    second = queries.step_detail(run, 6).conversation
    assert second is not None
    # the echoed output items, then the function call's output; the first two were sent
    # by the earlier call
    assert roles(second) == ["developer", "user", "assistant", "assistant", "tool"]
    assert [m["new"] for m in second["turns"]] == [False, False, True, True, True]
    assert second["turns"][2]["blocks"] == [{"type": "text", "text": LOOKING}]
    [echoed] = second["turns"][3]["blocks"]
    assert echoed["type"] == "tool_use" and echoed["id"] == call["id"]
    [result] = second["turns"][4]["blocks"]
    assert (result["type"], result["tool_use_id"], result["name"]) == \
        ("tool_result", call["id"], "weather")
    assert result["blocks"] == [{"type": "text", "text": "東京: sunny, 22°C"}]
    assert second["response"]["streamed"]
    assert second["response"]["blocks"] == [{"type": "text", "text": ANSWER}]


def test_the_search_finds_responses_inputs_and_outputs(run: Path) -> None:
    steps = list(load(run))
    assert "Answer in one line." in searchable_text(steps[4])
    assert SYSTEM in searchable_text(steps[4]) and LOOKING in searchable_text(steps[4])
    assert "東京: sunny, 22°C" in searchable_text(steps[6])
    with RunIndex(run.parent) as idx:
        idx.refresh()
        assert len(queries.list_runs(idx, text="answer in one LINE")) == 1


def test_the_step_page_shows_an_openai_conversation(run: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEJA_VIEW_DIR", str(run.parent))
    at = AppTest.from_file(str(APP), default_timeout=30)
    at.query_params.update(run=load(run).run, step="6")
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    # system (the instructions), the new turns, the reply; the earlier two folded
    assert [c.name for c in at.chat_message] == ["system", "developer", "user", "assistant",
                                                 "assistant", "tool", "assistant"]
    assert "Earlier messages of the conversation (2)" in [e.label for e in at.expander]
    markdown = [str(m.value) for m in at.markdown]
    assert any("tool call** `weather`" in m for m in markdown)
    assert any("tool result** of `weather`" in m for m in markdown)
    assert ANSWER in [str(t.value) for t in at.text]  # a run's words: text, not markup
    assert "東京: sunny, 22°C" in [str(c.value) for c in at.code]
    captions = [unescape(str(c.value)) for c in at.caption]  # as they read
    assert any("streamed" in c and "stop: completed" in c and "tokens in/out: 40/6" in c
               for c in captions)
