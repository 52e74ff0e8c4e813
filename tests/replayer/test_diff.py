"""deja diff: two runs compared step by step, by what each step means.

Runs are recorded with the real anthropic SDK against the stub server (every recording
gets fresh message ids, tool-use ids, request ids and timings) and compared through the
CLI: exit 0 same, 1 different, 2 a cassette that cannot be read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import pytest
from click.testing import CliRunner, Result
from conftest import MODEL, _collect_clients, read_lines

import recorder
from deja.cli import main as cli
from recorder.testing.server import StubServer

PROMPT = "Where is the session refresh implemented?"
TOOLS = [{"name": "find", "description": "Find files by query.",
          "input_schema": {"type": "object", "properties": {"query": {"type": "string"}},
                           "required": ["query"]}}]
SCRIPT = {"select": "conversation", "turns": [
    {"text": "Searching.", "tool_use": {"name": "find", "input": {"query": "session refresh"}},
     "usage": {"input_tokens": 120, "output_tokens": 20}},
    {"text": "Narrowing it down.", "tool_use": {"name": "find", "input": {"query": "auth/"}},
     "usage": {"input_tokens": 180, "output_tokens": 22}},
    {"text": "It is in auth/session.py.", "usage": {"input_tokens": 240, "output_tokens": 9}}]}


@recorder.tool
def find(query: str) -> list[str]:
    return ["auth/session.py"] if "session" in query else ["auth/session.py", "auth/token.py"]


def agent(base_url: str, prompt: str = PROMPT, max_turns: int = 5) -> str:
    client = anthropic.Anthropic(base_url=base_url, api_key="sk-test", max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
    for _ in range(max_turns):
        reply = client.messages.create(model=MODEL, max_tokens=256, tools=TOOLS,
                                       messages=messages)
        content = [b.model_dump(exclude_none=True) for b in reply.content]
        messages.append({"role": "assistant", "content": content})
        if reply.stop_reason != "tool_use":
            return reply.content[0].text
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": b.id, "content": json.dumps(find(**b.input))}
            for b in reply.content if b.type == "tool_use"]})
    return "out of turns"


def record(path: Path, **kwargs: Any) -> Path:
    """One run against a fresh stub: new message ids, tool-use ids and timings each time."""
    with StubServer(SCRIPT) as server, recorder.record(path):
        agent(server.url, **kwargs)
    _collect_clients()  # the agent's client, with its pooled connection to a stopped stub
    return path


def diff(a: Path, b: Path, *options: str) -> Result:
    return CliRunner().invoke(cli, ["diff", str(a), str(b), *options])


@pytest.fixture
def run_a(tmp_path: Path) -> Path:
    return record(tmp_path / "a.jsonl")


def test_the_same_run_recorded_twice_is_the_same(run_a: Path, tmp_path: Path) -> None:
    run_b = record(tmp_path / "b.jsonl")
    a, b = read_lines(run_a), read_lines(run_b)
    assert [line.get("kind") for line in a] == [line.get("kind") for line in b]
    # Everything that differs between any two runs does differ here.
    assert a[0]["run"] != b[0]["run"]
    bodies = [(x["response"]["body_json"], y["response"]["body_json"])
              for x, y in zip(a, b, strict=True) if x.get("kind") == "model"]
    assert all(x["id"] != y["id"] for x, y in bodies)  # message ids
    assert bodies[0][0]["content"][1]["id"] != bodies[0][1]["content"][1]["id"]  # tool use
    assert [line.get("sig") for line in a] != [line.get("sig") for line in b]

    result = diff(run_a, run_b)
    assert result.exit_code == 0, result.output
    assert "same: every step means the same in both runs" in result.output
    assert "(5 steps)" in result.output  # 3 model calls and 2 tool calls; the end line is none
    data = json.loads(diff(run_a, run_b, "--json").output)
    assert data["same"] is True and data["first_divergence"] is None
    assert data["same_prefix"] == data["steps_a"] == data["steps_b"] == 5
    assert data["steps"] == []


def test_a_changed_prompt_diverges_at_step_0(run_a: Path, tmp_path: Path) -> None:
    changed = record(tmp_path / "changed.jsonl", prompt="Find the token refresh code.")
    result = diff(run_a, changed)
    assert result.exit_code == 1, result.output
    assert "first divergence: step 0" in result.output
    assert "identical" not in result.output  # no identical prefix to collapse
    assert "step 0 (model):" in result.output
    assert "/request/messages/0/content:" in result.output
    assert PROMPT in result.output and "Find the token refresh code." in result.output

    data = json.loads(diff(run_a, changed, "--json").output)
    assert data["same"] is False
    assert data["first_divergence"] == 0 and data["same_prefix"] == 0
    step0 = data["steps"][0]
    assert step0["seq"] == 0 and step0["kind_a"] == step0["kind_b"] == "model"
    prompt = [c for c in step0["changes"] if c["path"] == "/request/messages/0/content"]
    assert prompt == [{"path": "/request/messages/0/content", "op": "replace",
                       "a": PROMPT, "b": "Find the token refresh code."}]
    # Later requests repeat the prompt, so they differ too; the tool steps do not.
    assert [s["seq"] for s in data["steps"]] == [0, 2, 4]


def test_a_run_that_stops_early_has_steps_only_in_a(run_a: Path, tmp_path: Path) -> None:
    short = record(tmp_path / "short.jsonl", max_turns=1)
    assert [line.get("kind") for line in read_lines(short)[1:]] == ["model", "tool", "end"]
    result = diff(run_a, short)
    assert result.exit_code == 1, result.output
    assert "steps 0-1: identical (2 steps)" in result.output
    assert "first divergence: A's step 2, B's end line" in result.output
    assert "A's step 2, B's end line (model -> end):" in result.output
    assert "only in A: 2 step(s), 3 tool, 4 model, then its end line" in result.output
    reverse = diff(short, run_a)
    assert reverse.exit_code == 1
    assert "step 2, A's end line (end -> model):" in reverse.output
    assert "only in B: 2 step(s), 3 tool, 4 model, then its end line" in reverse.output

    data = json.loads(diff(run_a, short, "--json").output)
    assert data["first_divergence"] == 2 and data["same_prefix"] == 2
    assert data["steps_a"] == 5 and data["steps_b"] == 2
    only_a = [s for s in data["steps"] if s["kind_b"] is None]
    assert [s["seq"] for s in only_a] == [3, 4, 5]
    assert all(s["changes"][0]["op"] == "missing" for s in only_a)
    assert only_a[0]["changes"][0]["a"]["name"] == "find"
    assert only_a[0]["changes"][0]["a"]["args"] == {"query": "auth/"}


def test_json_lists_the_changed_fields_of_every_step(run_a: Path, tmp_path: Path) -> None:
    changed = record(tmp_path / "turns.jsonl", max_turns=2)
    data = json.loads(diff(run_a, changed, "--json").output)
    assert set(data) >= {"run_a", "run_b", "steps_a", "steps_b", "same_prefix",
                         "first_divergence", "steps", "same"}
    assert data["first_divergence"] == 4 and data["same_prefix"] == 4
    step = data["steps"][0]
    assert step["seq"] == 4 and (step["kind_a"], step["kind_b"]) == ("model", "end")
    assert step["changes"] == [{"path": "/kind", "op": "replace", "a": "model", "b": "end"}]
    for step in data["steps"]:
        for change in step["changes"]:
            assert set(change) == {"path", "op", "a", "b"}


def test_a_changed_model_answer_lists_message_usage_and_cost_paths(tmp_path: Path) -> None:
    a = record(tmp_path / "a.jsonl")
    script = json.loads(json.dumps(SCRIPT))
    script["turns"][2] = {"text": "It is in auth/refresh.py.",
                          "usage": {"input_tokens": 240, "output_tokens": 30}}
    b = tmp_path / "b.jsonl"
    with StubServer(script) as server, recorder.record(b):
        agent(server.url)
    data = json.loads(diff(a, b, "--json").output)
    assert data["first_divergence"] == 4
    paths = {c["path"]: c for c in data["steps"][0]["changes"]}
    assert paths["/response/message/content/0/text"]["b"] == "It is in auth/refresh.py."
    assert paths["/usage/output_tokens"]["a"] == 9 and paths["/usage/output_tokens"]["b"] == 30
    assert "/cost_usd" in paths
    # The end line's totals count the extra tokens too.
    assert any(c["path"].startswith("/totals/") for s in data["steps"] for c in s["changes"]
               if s["kind_a"] == "end")


def test_a_torn_or_incomplete_cassette_still_diffs(run_a: Path, tmp_path: Path) -> None:
    raw = run_a.read_bytes()
    lines = raw.splitlines(keepends=True)
    incomplete = tmp_path / "incomplete.jsonl"  # cut at a line boundary: no end line
    incomplete.write_bytes(b"".join(lines[:-1]))
    torn = tmp_path / "torn.jsonl"  # the last observation cut mid-line as a crash leaves it
    torn.write_bytes(b"".join(lines[:-2]) + lines[-2][: len(lines[-2]) // 2])

    result = diff(run_a, incomplete)
    assert result.exit_code == 1, result.output
    assert "steps 0-4: identical (5 steps)" in result.output
    assert "only in A: its end line" in result.output

    result = diff(run_a, torn)
    assert result.exit_code == 1, result.output
    assert "first divergence: step 4" in result.output
    assert "only in A: 1 step(s), 4 model, then its end line" in result.output

    same = diff(incomplete, incomplete)
    assert same.exit_code == 0 and "same" in same.output
    assert run_a.read_bytes() == raw


def test_an_unreadable_cassette_exits_2(run_a: Path, tmp_path: Path) -> None:
    future = tmp_path / "future.jsonl"
    future.write_text('{"format":"deja/99"}\n')
    result = diff(run_a, future)
    assert result.exit_code == 2
    assert "deja/99" in result.output and "upgrade deja" in result.output
    tampered = tmp_path / "tampered.jsonl"
    tampered.write_text(run_a.read_text().replace("Searching.", "Searching!"))
    result = diff(run_a, tampered)
    assert result.exit_code == 2
    assert "signature check failed at seq 0" in result.output


def test_two_runs_stopped_by_the_same_guard_are_the_same(tmp_path: Path) -> None:
    """The harness's control line names its run; two runs stopped alike still compare the
    same, and a different decision still differs."""
    looping = {"select": "conversation", "default": {
        "text": "Again.", "tool_use": {"name": "find", "input": {"query": "session refresh"}}}}
    paths = []
    for name in ("a.jsonl", "b.jsonl"):
        with StubServer(looping) as server, recorder.record(tmp_path / name):
            with pytest.raises(recorder.LoopDetected):
                agent(server.url, max_turns=10)
        _collect_clients()
        paths.append(tmp_path / name)
    controls = [next(line for line in read_lines(p) if line.get("kind") == "control")
                for p in paths]
    runs = [read_lines(p)[0]["run"] for p in paths]
    assert runs[0] in controls[0]["detail"]["message"] and runs[1] in controls[1]["detail"][
        "message"]
    result = diff(*paths)
    assert result.exit_code == 0, result.output
    with StubServer(looping) as server, recorder.record(tmp_path / "c.jsonl",
                                                        loop_guard={"repeats": 4}):
        with pytest.raises(recorder.LoopDetected):
            agent(server.url, max_turns=10)
    _collect_clients()
    assert diff(paths[0], tmp_path / "c.jsonl").exit_code == 1
