"""Declared volatility: what changes between two runs of the same agent without changing
what it asks a model, declared once, so that a replay finds such a run equivalent.

Each provider declares its own (tool-use ids, which are renamed by their order of first
appearance; a user id, cache markers, OpenAI's ``user``); a project declares its own in
``[tool.deja.match]`` of its ``pyproject.toml``. Real SDKs (anthropic, openai,
google-genai) against the stub server record agents that mint their own tool-use ids, or
send today's date, and replay them with fresh ids and another date: through
``replayer.replay``, ``deja replay`` and the pytest marker. A result paired with the wrong
call still diverges, and so does the date when no normaliser is declared.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from conftest import MODEL
from google import genai
from google.genai import types

import recorder
import replayer
from recorder.errors import ConfigError
from replayer.policy import ReplayPolicy

OFFLINE = "http://127.0.0.1:9"  # nothing listens there: a replay serves every call
TOOLS = [{"name": "forecast", "description": "The forecast for a city.",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}]
TWO_CALLS = {"select": "conversation", "turns": [
    {"text": "Checking.", "tool_use": [{"name": "forecast", "input": {"city": "Paris"}},
                                       {"name": "forecast", "input": {"city": "Rome"}}]},
    {"text": "Paris 21, Rome 25."}]}
ANSWER = "Paris 21, Rome 25."


def forecast(city: str) -> str:
    return f"{city}: {21 if city == 'Paris' else 25}"


def fresh(prefix: str) -> str:
    """An id the agent mints itself, new in every run."""
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def anthropic_agent(url: str, *, wrong_pairing: bool = False, user: str = "u-1",
                    marker_on: str = "system") -> str:
    """A tool loop whose history the agent keeps under ids of its own (as an agent
    framework does), a user id per session, and a prompt-cache marker where it likes."""
    client = anthropic.Anthropic(base_url=url, api_key="sk-stub", max_retries=0)
    marker = {"cache_control": {"type": "ephemeral"}}
    system = [{"type": "text", "text": "You are a weather assistant.",
               **(marker if marker_on == "system" else {})}]
    question = [{"type": "text", "text": "Weather in Paris and Rome?",
                 **(marker if marker_on == "question" else {})}]
    ask: dict[str, Any] = {"model": MODEL, "max_tokens": 128, "tools": TOOLS, "system": system,
                           "metadata": {"user_id": user}}
    messages: list[Any] = [{"role": "user", "content": question}]
    first = client.messages.create(messages=messages, **ask)
    calls = [block for block in first.content if block.type == "tool_use"]
    ids = [fresh("toolu_") for _ in calls]
    results = [{"type": "tool_result", "tool_use_id": i, "content": forecast(c.input["city"])}
               for i, c in zip(ids, calls, strict=True)]
    if wrong_pairing:  # each result sent as the other call's
        results[0]["tool_use_id"], results[1]["tool_use_id"] = ids[1], ids[0]
    messages += [{"role": "assistant", "content": [
                     {"type": "tool_use", "id": i, "name": c.name, "input": c.input}
                     for i, c in zip(ids, calls, strict=True)]},
                 {"role": "user", "content": results}]
    return client.messages.create(messages=messages, **ask).content[0].text  # type: ignore[union-attr]


def recorded(stub: Any, path: Path, agent: Callable[[str], Any], answer: Any) -> Path:
    """``agent`` recorded at ``path`` against the stub asking for two tool calls."""
    server = stub(TWO_CALLS)
    with recorder.record(path):
        assert agent(server.url) == answer
    server.stop()
    return path


@pytest.fixture
def rekeyed(stub: Any, tmp_path: Path) -> Path:
    return recorded(stub, tmp_path / "rekeyed.jsonl", anthropic_agent, ANSWER)


def test_regenerated_tool_use_ids_never_diverge(rekeyed: Path) -> None:
    for policy in (None, ReplayPolicy()):  # deja's own policy, and one that lists nothing
        with replayer.replay(rekeyed, policy=policy) as run:
            assert anthropic_agent(OFFLINE) == ANSWER
        result = run.result
        assert result is not None and result.verdict == "equivalent", result.report()
        assert result.grades == {"exact": 1, "equivalent": 1, "diverged": 0}
        (second,) = result.equivalent
        assert sorted(second["fields"]) == ["/messages/*/content/*/id",
                                            "/messages/*/content/*/tool_use_id"]
        assert ": equivalent: identical but for declared-volatile fields" in result.report()


def test_a_result_paired_with_the_wrong_call_still_diverges(rekeyed: Path) -> None:
    with pytest.raises(recorder.Divergence) as diverged, replayer.replay(rekeyed):
        anthropic_agent(OFFLINE, wrong_pairing=True)
    assert diverged.value.info.category == "changed_request"
    assert diverged.value.info.changed == ("prompt",)


def test_a_user_id_and_a_moved_cache_marker_are_declared_by_the_provider(rekeyed: Path) -> None:
    with replayer.replay(rekeyed) as run:
        assert anthropic_agent(OFFLINE, user="u-2", marker_on="question") == ANSWER
    assert run.result is not None and run.result.verdict == "equivalent"
    first = sorted(run.result.equivalent[0]["fields"])
    assert first == ["/messages/*/content/*/cache_control", "/metadata/user_id",
                     "/system/*/cache_control"], first
    # A policy built by hand lists exactly what it leaves out: the user id counts again,
    # unless it takes the providers' declarations.
    with pytest.raises(recorder.Divergence), replayer.replay(rekeyed, policy=ReplayPolicy()):
        anthropic_agent(OFFLINE, user="u-2")
    with replayer.replay(rekeyed, policy=ReplayPolicy(providers=True)):
        anthropic_agent(OFFLINE, user="u-2")


CHAT_TOOLS = [{"type": "function", "function": {
    "name": "forecast", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}}}]
RESPONSE_TOOLS = [{"type": "function", "name": "forecast",
                   "parameters": CHAT_TOOLS[0]["function"]["parameters"]}]


def openai_agent(url: str) -> list[str]:
    """Chat Completions and Responses tool loops whose history carries call ids the agent
    minted, for an end user named anew each run."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-stub", max_retries=0)
    user = fresh("user-")
    messages: list[Any] = [{"role": "user", "content": "Weather in Paris and Rome?"}]
    first = client.chat.completions.create(model="gpt-4.1", messages=messages,
                                           tools=CHAT_TOOLS, user=user)  # type: ignore[arg-type]
    calls = first.choices[0].message.tool_calls or []
    ids = [fresh("call_") for _ in calls]
    messages.append({"role": "assistant", "content": None, "tool_calls": [
        {"id": i, "type": "function", "function": {"name": c.function.name,  # type: ignore[union-attr]
                                                   "arguments": c.function.arguments}}  # type: ignore[union-attr]
        for i, c in zip(ids, calls, strict=True)]})
    messages += [{"role": "tool", "tool_call_id": i,
                  "content": forecast(json.loads(c.function.arguments)["city"])}  # type: ignore[union-attr]
                 for i, c in zip(ids, calls, strict=True)]
    chat = client.chat.completions.create(model="gpt-4.1", messages=messages, tools=CHAT_TOOLS,
                                          user=user)  # type: ignore[arg-type]
    items: list[Any] = [{"role": "user", "content": "Weather in Paris and Rome?"}]
    response = client.responses.create(model="gpt-4.1", input=items, tools=RESPONSE_TOOLS)  # type: ignore[arg-type]
    asked = [(fresh("call_"), o) for o in response.output if o.type == "function_call"]
    items += [{"type": "function_call", "call_id": minted, "name": call.name,
               "arguments": call.arguments} for minted, call in asked]
    items += [{"type": "function_call_output", "call_id": minted,
               "output": forecast(json.loads(call.arguments)["city"])} for minted, call in asked]
    answer = client.responses.create(model="gpt-4.1", input=items, tools=RESPONSE_TOOLS)  # type: ignore[arg-type]
    return [str(chat.choices[0].message.content), answer.output_text]


def test_openai_call_ids_and_user_are_declared_volatile(stub: Any, tmp_path: Path) -> None:
    path = recorded(stub, tmp_path / "openai.jsonl", openai_agent, [ANSWER, ANSWER])
    with replayer.replay(path) as run:
        assert openai_agent(OFFLINE) == [ANSWER, ANSWER]
    result = run.result
    assert result is not None and result.verdict == "equivalent", result.report()
    assert result.grades == {"exact": 1, "equivalent": 3, "diverged": 0}
    fields = [sorted(call["fields"]) for call in result.equivalent]
    assert fields == [["/user"], ["/messages/*/tool_call_id", "/messages/*/tool_calls/*/id",
                                  "/user"], ["/input/*/call_id"]], fields


GEMINI_TOOL = types.Tool(function_declarations=[types.FunctionDeclaration(
    name="forecast", description="The forecast for a city.",
    parameters=types.Schema(type=types.Type.OBJECT,
                            properties={"city": types.Schema(type=types.Type.STRING)}))])
GEMINI_CONFIG = types.GenerateContentConfig(
    tools=[GEMINI_TOOL],
    automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True))


def gemini_agent(url: str) -> str:
    """A function-calling loop that gives each call and its response an id of its own."""
    with genai.Client(api_key="AIza-stub", http_options=types.HttpOptions(base_url=url)) as c:
        contents: list[Any] = ["Weather in Paris and Rome?"]
        first = c.models.generate_content(model="gemini-2.5-flash", contents=contents,
                                          config=GEMINI_CONFIG)
        calls = [(fresh("fc-"), call) for call in first.function_calls or []]
        contents.append(types.Content(role="model", parts=[
            types.Part(function_call=types.FunctionCall(id=i, name=call.name, args=call.args))
            for i, call in calls]))
        contents.append(types.Content(role="user", parts=[
            types.Part(function_response=types.FunctionResponse(
                id=i, name=call.name, response={"text": forecast(str((call.args or {})["city"]))}))
            for i, call in calls]))
        return str(c.models.generate_content(model="gemini-2.5-flash", contents=contents,
                                             config=GEMINI_CONFIG).text)


def test_gemini_function_call_ids_are_declared_volatile(stub: Any, tmp_path: Path) -> None:
    path = recorded(stub, tmp_path / "gemini.jsonl", gemini_agent, ANSWER)
    with replayer.replay(path) as run:
        assert gemini_agent(OFFLINE) == ANSWER
    assert run.result is not None and run.result.verdict == "equivalent", run.result.report()
    assert run.result.equivalent[0]["fields"] == [
        "/contents/*/parts/*/functionCall/id", "/contents/*/parts/*/functionResponse/id"]


# ------------------------------------------------------------------ [tool.deja.match]

DATED = f'''\
import os, anthropic
client = anthropic.Anthropic(base_url=os.environ.get("AGENT_URL", "{OFFLINE}"), api_key="k",
                             max_retries=0)
reply = client.messages.create(
    model="{MODEL}", max_tokens=64,
    system=f"Today is {{os.environ['TODAY']}}. You are a billing assistant.",
    messages=[{{"role": "user", "content": "What is due?"}}])
print(reply.content[0].text)
'''
MATCH = "[tool.deja.match]\nnormalise = ['[0-9]{4}-[0-9]{2}-[0-9]{2}=DATE']\n"


@pytest.fixture
def project(stub: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A project whose pyproject.toml declares the date volatile, and a run of its agent
    recorded on 2026-12-01."""
    monkeypatch.delenv("DEJA_CONFIG", raising=False)
    root = tmp_path / "project"
    root.mkdir()
    (root / "pyproject.toml").write_text(f"[project]\nname = 'billing'\n\n{MATCH}")
    (root / "agent.py").write_text(DATED)
    server = stub({"default": {"text": "INV-7 is due."}})
    run = subprocess.run([sys.executable, "-m", "deja", "record", "-o", "dated.jsonl", "--",
                          sys.executable, "agent.py"], cwd=root, text=True,
                         capture_output=True, timeout=120,
                         env={**os.environ, "TODAY": "2026-12-01", "AGENT_URL": server.url})
    assert run.returncode == 0, run.stdout + run.stderr
    server.stop()
    return root


def test_a_date_normalised_in_the_project_replays_and_diverges_without_it(
        project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def deja_replay(cwd: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "deja", "replay",
                               str(project / "dated.jsonl"), "--", sys.executable,
                               str(project / "agent.py")], cwd=cwd, text=True,
                              capture_output=True, timeout=120,
                              env={**os.environ, "TODAY": "2027-03-04"})

    inside = deja_replay(project)
    assert inside.returncode == 0, inside.stdout + inside.stderr
    assert ": equivalent: identical but for declared-volatile fields" in inside.stdout
    assert "equivalent: step 0, differing only in /system" in inside.stdout
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "pyproject.toml").write_text("[project]\nname = 'other'\n")
    outside = deja_replay(elsewhere)
    assert outside.returncode == 1, outside.stdout + outside.stderr
    assert "kind: changed_request (prompt)" in outside.stdout

    monkeypatch.setenv("TODAY", "2027-03-04")
    monkeypatch.chdir(project)
    agent = compile(DATED, "agent.py", "exec")
    with replayer.replay(project / "dated.jsonl") as run:
        exec(agent, {"__name__": "agent"})
    assert run.result is not None and run.result.equivalent == ({"step": 0,
                                                                 "fields": ["/system"]},)
    monkeypatch.chdir(elsewhere)
    with pytest.raises(recorder.Divergence), replayer.replay(project / "dated.jsonl"):
        exec(agent, {"__name__": "agent"})


def test_the_marker_adds_to_the_projects_rules(pytester: pytest.Pytester,
                                               project: Path) -> None:
    pytester.makepyprojecttoml(f"[tool.pytest.ini_options]\n"
                               f"asyncio_default_fixture_loop_scope = 'function'\n\n{MATCH}")
    pytester.makepyfile(textwrap.dedent(f"""
        import os, runpy, pytest

        @pytest.mark.deja({str(project / "dated.jsonl")!r})
        def test_another_day(monkeypatch):
            monkeypatch.setenv("TODAY", "2030-01-31")
            runpy.run_path({str(project / "agent.py")!r})

        @pytest.mark.deja({str(project / "dated.jsonl")!r}, normalise=["What=How"])
        def test_another_question(monkeypatch):
            monkeypatch.setenv("TODAY", "2030-01-31")
            runpy.run_path({str(project / "agent.py")!r})
    """))
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)


def test_a_bad_rule_in_the_project_is_refused_naming_the_file(
        project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (project / "pyproject.toml").write_text("[tool.deja.match]\nignore = ['metadata']\n")
    monkeypatch.chdir(project)
    with pytest.raises(ConfigError, match=r"pyproject.toml: \[tool.deja.match\]: ignore "
                                          r"'metadata': a JSON pointer starts with /"):
        with replayer.replay(project / "dated.jsonl"):
            pass
    (project / "pyproject.toml").write_text("[tool.deja.match]\nproviders = 'yes'\n")
    with pytest.raises(ConfigError, match="providers is true or false"):
        ReplayPolicy.configured()
