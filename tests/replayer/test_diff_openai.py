"""deja diff of OpenAI runs: Chat Completions and the Responses API read as conversations.

Runs are recorded with the real openai SDK against the stub server: a chat tool loop and a
Responses tool loop, each calling a recorded tool. Every recording has fresh completion
ids, tool-call ids and output-item ids; the diff reads each call as its messages (tool
calls with parsed arguments, tool results), so two recordings of the same behaviour are
the same and a changed tool result or prompt is named by step and message.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest
from click.testing import CliRunner, Result
from conftest import _collect_clients

import recorder
from deja.cli import main as cli
from recorder.cassette import load
from recorder.testing.server import StubServer

MODEL = "gpt-4.1"  # a model the openai SDK knows and does not warn about
PROMPT = "What does 'deja' mean?"
PARAMETERS = {"type": "object", "properties": {"word": {"type": "string"}},
              "required": ["word"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": PARAMETERS}}]
RESPONSE_TOOLS = [{"type": "function", "name": "lookup", "parameters": PARAMETERS}]
SCRIPT = {"select": "conversation", "turns": [
    {"text": "Let me look that up.", "tool_use": {"name": "lookup", "input": {"word": "deja"}},
     "usage": {"input_tokens": 50, "output_tokens": 8}},
    {"text": "It means 'already'.", "usage": {"input_tokens": 80, "output_tokens": 6}}]}
MEANING = {"deja": "French for 'already'"}


@recorder.tool
def lookup(word: str) -> str:
    return f"{word}: {MEANING[word]}"


def agent(url: str, prompt: str = PROMPT) -> None:
    """A chat tool loop, then a Responses tool loop (steps 0-2 and 3-5)."""
    with openai.OpenAI(base_url=f"{url}/v1", api_key="sk-test", max_retries=0) as c:
        messages: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": prompt}]
        first = c.chat.completions.create(model=MODEL, messages=messages, tools=CHAT_TOOLS)
        message = first.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        messages += [{"role": "tool", "tool_call_id": call.id,
                      "content": lookup(**json.loads(call.function.arguments))}
                     for call in message.tool_calls or []]
        c.chat.completions.create(model=MODEL, messages=messages, tools=CHAT_TOOLS)

        items: list[Any] = [{"role": "user", "content": prompt}]
        response = c.responses.create(model=MODEL, instructions="Be brief.", input=items,
                                      tools=RESPONSE_TOOLS)
        items += [item.model_dump(exclude_none=True) for item in response.output]
        items += [{"type": "function_call_output", "call_id": item.call_id,
                   "output": lookup(**json.loads(item.arguments))}
                  for item in response.output if item.type == "function_call"]
        c.responses.create(model=MODEL, instructions="Be brief.", input=items,
                           tools=RESPONSE_TOOLS)


def record(path: Path, script: dict | None = None, **kwargs: Any) -> Path:
    with StubServer(script or SCRIPT) as server, recorder.record(path):
        agent(server.url, **kwargs)
    _collect_clients()
    return path


def diff(a: Path, b: Path, *options: str) -> Result:
    return CliRunner().invoke(cli, ["diff", str(a), str(b), *options])


@pytest.fixture
def run_a(tmp_path: Path) -> Path:
    return record(tmp_path / "a.jsonl")


def test_the_same_openai_run_recorded_twice_is_the_same(run_a: Path, tmp_path: Path) -> None:
    run_b = record(tmp_path / "b.jsonl")
    ids = [[o["message_id"] for o in load(p) if o["kind"] == "model"] for p in (run_a, run_b)]
    assert len(ids[0]) == 4 and not set(ids[0]) & set(ids[1])  # fresh ids in every run
    result = diff(run_a, run_b)
    assert result.exit_code == 0, result.output
    assert "same: every step means the same in both runs" in result.output
    assert "(6 steps)" in result.output


def test_a_changed_tool_result_is_named_by_step_and_message(
        run_a: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(MEANING, "deja", "French for 'seen before'")
    run_b = record(tmp_path / "b.jsonl")
    result = diff(run_a, run_b)
    assert result.exit_code == 1, result.output
    out = result.output
    assert "first divergence: step 1" in out
    assert "step 1 (tool):\n  /result: \"deja: French for 'already'\" -> " \
           "\"deja: French for 'seen before'\"" in out
    # the chat request: system, user, assistant (tool call), tool (result)
    assert ("step 2 (model):\n  /request/messages/3/content/0/content: "
            "\"deja: French for 'already'\" -> \"deja: French for 'seen before'\"  "
            "[message 3 (tool): tool result of lookup]") in out
    # the Responses input: user, the assistant's message and function call, its output
    step5 = out.split("step 5 (model):\n")[1].splitlines()[0]
    assert step5.startswith("  /request/messages/3/content/0/content: ")
    assert step5.endswith("[message 3 (tool): tool result of lookup]")
    data = json.loads(diff(run_a, run_b, "--json").output)
    assert [s["seq"] for s in data["steps"]] == [1, 2, 4, 5]
    step2 = data["steps"][1]
    assert step2["changes"] == [{"path": "/request/messages/3/content/0/content",
                                 "op": "replace", "a": "deja: French for 'already'",
                                 "b": "deja: French for 'seen before'"}]
    assert step2["messages"] == {"/request/messages/3/content/0/content":
                                 "message 3 (tool): tool result of lookup"}


def test_a_changed_prompt_is_named_in_each_api(run_a: Path, tmp_path: Path) -> None:
    run_b = record(tmp_path / "b.jsonl", prompt="What does 'vu' mean?")
    out = diff(run_a, run_b).output
    assert "first divergence: step 0" in out
    assert ("step 0 (model):\n  /request/messages/1/content: "
            "\"What does 'deja' mean?\" -> \"What does 'vu' mean?\"  [message 1 (user)]") in out
    assert ("step 3 (model):\n  /request/messages/0/content: "
            "\"What does 'deja' mean?\" -> \"What does 'vu' mean?\"  [message 0 (user)]") in out


def test_a_changed_answer_and_tool_call_are_named_in_the_reply(run_a: Path,
                                                               tmp_path: Path) -> None:
    script = json.loads(json.dumps(SCRIPT))
    script["turns"][0]["tool_use"]["input"] = {"word": "vu"}
    script["turns"][1]["text"] = "It means 'seen'."
    MEANING["vu"] = "French for 'seen'"
    run_b = record(tmp_path / "b.jsonl", script)
    out = diff(run_a, run_b).output
    for step in (0, 3):  # chat tool_calls and the Responses function_call alike
        assert (f"step {step} (model):\n  /response/message/content/1/input/word: "
                "\"deja\" -> \"vu\"  [reply: tool call lookup]") in out
    for step in (2, 5):
        assert ("/response/message/content/0/text: \"It means 'already'.\" -> "
                "\"It means 'seen'.\"  [reply: text]") in out.split(f"step {step} (model):")[1]
