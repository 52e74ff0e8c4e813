"""Replay, then live, through the proxy: ``deja proxy --replay C --then live``.

A three-turn conversation with two tool results (search, then fetch, then an answer) is
recorded once through a real ``deja proxy`` with the anthropic SDK against the stub. A
changed agent then runs against ``deja proxy --replay C --then live --upstream STUB2``:
what it asks as before is served from the recording (STUB2 never sees it), and from the
first request the recording does not hold, or the first tool result other than the
recorded one, every request goes to STUB2, into a new cassette that names the parent and
the step it left, and that replays whole. After it left, the tool policy: the agent ran
its tool all the same, which the proxy says, and a ``recorded`` or ``static`` rule gives
the model its answer in place of the agent's result. The TypeScript SDK agent goes
through the same, served whole and then live.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anthropic
import pytest
from node_helpers import STUB_ANSWER, STUB_SCRIPT, ensure_node_modules, node_agent, read_dump
from proxy_helpers import ProxyProcess, cassettes, lines, load_verified, run_proxy, start_proxy

from recorder.cassette import Cassette
from recorder.testing.server import StubServer

MODEL = "claude-sonnet-4-6"
Proxy = Callable[..., ProxyProcess]
Stub = Callable[[dict], StubServer]

SCRIPT = {  # search, then fetch, then an answer: three model calls, two tool results
    "model": MODEL, "select": "conversation",
    "turns": [{"text": "Searching.", "tool_use": {"name": "search", "input": {"q": "x"}}},
              {"text": "Fetching.", "tool_use": {"name": "fetch", "input": {"url": "u"}}},
              {"text": "Done: {echo}"}]}
TOOLS = [{"name": name, "description": f"The {name} tool.",
          "input_schema": {"type": "object", "properties": {}}} for name in ("search", "fetch")]


def search(q: str) -> str:
    return f"3 results for {q}"


def fetch(url: str) -> str:
    return f"the page at {url}"


@dataclass
class Agent:
    """A tool loop on the Python SDK; ``changed``: the request numbers (1-based) it sends
    with another max_tokens than the recorded agent did; ``tools``: its tools."""

    changed: tuple[int, ...] = ()
    tools: dict[str, Callable[..., str]] = field(
        default_factory=lambda: {"search": search, "fetch": fetch})
    bodies: list[bytes] = field(default_factory=list)  # the response bodies it got

    def run(self, url: str) -> str:
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Find x"}]
        with anthropic.Anthropic(base_url=url, api_key="sk-test", max_retries=0) as client:
            for n in range(1, 6):
                raw = client.messages.with_raw_response.create(
                    model=MODEL, max_tokens=300 if n in self.changed else 256, tools=TOOLS,
                    messages=messages)
                self.bodies.append(raw.http_response.content)
                message = raw.parse()
                messages.append({"role": "assistant", "content": [
                    b.model_dump(mode="json", exclude_none=True) for b in message.content]})
                uses = [b for b in message.content if b.type == "tool_use"]
                if not uses:
                    return message.content[0].text  # type: ignore[union-attr]
                messages.append({"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": b.id,
                     "content": self.tools[b.name](**b.input)} for b in uses]})
        raise AssertionError("no final answer")


@dataclass
class Recorded:
    path: Path
    bodies: list[bytes]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory,
             module_env: dict[str, str]) -> Iterator[Recorded]:
    """The conversation recorded once through the proxy: model, tool, model, tool, model."""
    work = tmp_path_factory.mktemp("recorded")
    with StubServer(SCRIPT) as upstream:
        recording = start_proxy(work, "--upstream", upstream.url, "--dir", str(work / "runs"),
                                env=module_env)
        try:
            agent = Agent()
            assert agent.run(recording.url).startswith("Done: ")
        finally:
            status, log = recording.stop()
        assert status == 0, log
    [path] = cassettes(work / "runs")
    yield Recorded(path, agent.bodies)


@pytest.fixture
def parent(recorded: Recorded, tmp_path: Path) -> Path:
    """A copy of the recording in the test's own folder (a new run is written next to it)."""
    target = tmp_path / "parent" / recorded.path.name
    target.parent.mkdir()
    shutil.copy(recorded.path, target)
    return target


def then_live(proxy: Proxy, parent: Path, upstream: StubServer, *args: str) -> ProxyProcess:
    return proxy("--replay", str(parent), "--then", "live", "--upstream", upstream.url, *args)


def stop(p: ProxyProcess) -> str:
    code, log = p.stop()
    assert code == 0, log
    return log


def kinds(cassette: Cassette) -> list[str]:
    return [o["kind"] for o in cassette.observations]


def tool_results(request: dict[str, Any]) -> list[Any]:
    """The tool results the stub received in ``request``, in order."""
    return [b["content"] for m in request["body"]["messages"] if m["role"] == "user"
            and isinstance(m["content"], list) for b in m["content"]
            if b.get("type") == "tool_result"]


def replays_whole(proxy: Proxy, path: Path, agent: Agent) -> str:
    """``deja proxy --replay PATH`` serves ``agent`` the whole new run; its log."""
    replaying = proxy("--replay", str(path))
    agent.run(replaying.url)
    log = stop(replaying)
    assert ": identical" in log, log
    return log


def test_a_changed_third_request_goes_live_and_the_turns_before_are_served(
        proxy: Proxy, stub: Stub, parent: Path, recorded: Recorded, tmp_path: Path) -> None:
    live = stub(SCRIPT)
    out = tmp_path / "fixed.jsonl"
    p = then_live(proxy, parent, live, "-o", str(out))
    agent = Agent(changed=(3,))
    assert agent.run(p.url).startswith("Done: ")
    assert len(live.requests) == 1  # turns 1 and 2 cost no live call
    assert tool_results(live.requests[0]) == ["3 results for x", "the page at u"]
    assert live.requests[0]["body"]["max_tokens"] == 300
    # served as a replay serves them: the recorded bytes
    assert agent.bodies[:2] == recorded.bodies[:2]
    assert agent.bodies[2] != recorded.bodies[2]
    log = stop(p)
    assert f"deja: replay, then live: served 4 step(s) of run {load_verified(parent).run}, " \
           "left it at step 4 (model, changed request): " in log, log
    assert "1 live call(s)" in log
    assert f"the new run was written to {out}" in log

    new, old = load_verified(out), load_verified(parent)
    assert new.header["parent"]["run"] == old.run
    assert new.header["parent"]["mode"] == "then_live"
    assert new.header["parent"]["step"] == 4
    assert new.header["parent"]["divergence"]["category"] == "changed_request"
    assert kinds(new) == ["model", "tool", "model", "tool", "model"]
    assert [o.get("result") for o in new.observations[:4]] == \
        [o.get("result") for o in old.observations[:4]]
    assert new.end is not None and new.end["status"] == "completed"
    replays_whole(proxy, out, Agent(changed=(3,)))


def test_a_changed_tool_result_leaves_the_recording_at_the_tool_step(
        proxy: Proxy, stub: Stub, parent: Path) -> None:
    live = stub(SCRIPT)
    p = then_live(proxy, parent, live)
    agent = Agent(tools={"search": search, "fetch": lambda url: f"a new page at {url}"})
    assert agent.run(p.url).startswith("Done: ")
    assert len(live.requests) == 1  # the request that carries the new result, and no other
    assert tool_results(live.requests[0]) == ["3 results for x", "a new page at u"]
    log = stop(p)
    assert "/v1/messages 400" not in log, log  # no divergence: the run went live
    assert "left it at step 3 (tool): the agent's tool 'fetch' returned something other " \
           "than the recorded result" in log, log
    [out] = [c for c in cassettes(parent.parent) if c != parent]  # next to its parent
    new = load_verified(out)
    assert new.header["parent"]["step"] == 3
    assert new.header["parent"]["divergence"]["kind"] == "tool"
    assert new.observations[3]["result"] == "a new page at u"
    assert "policy" not in new.observations[3]
    replays_whole(proxy, out, agent)


@pytest.mark.parametrize("rule", ["recorded", "static", "refuse"])
def test_a_tool_the_policy_would_not_run_ran_in_the_agent(
        proxy: Proxy, stub: Stub, parent: Path, tmp_path: Path, rule: str) -> None:
    """The second request changes, so the run goes live there; the fetch tool then runs
    in the agent against its rule: the proxy says so, and gives the model the rule's
    answer where it has one."""
    spec = {"recorded": "fetch=recorded", "static": 'fetch=static:{"cached": true}',
            "refuse": "fetch=refuse"}[rule]
    live = stub(SCRIPT)
    out = tmp_path / "fixed.jsonl"
    p = then_live(proxy, parent, live, "-o", str(out), "--tool", spec)
    agent = Agent(changed=(2,), tools={"search": search, "fetch": lambda url: "LIVE PAGE"})
    agent.run(p.url)
    assert len(live.requests) == 2
    log = stop(p)
    assert "left it at step 2 (model, changed request): " in log, log
    given = {"recorded": "the page at u", "static": '{"cached": true}',
             "refuse": "LIVE PAGE"}[rule]
    assert tool_results(live.requests[1])[-1] == given  # what the model saw
    assert "tool fetch ran in the agent: the proxy cannot stop an agent's own tool " \
           f"(step 3, rule {spec.split('=', 1)[1]}); " in log, log
    line = load_verified(out).observations[3]
    assert (line["name"], line["result"], line.get("policy")) == (
        "fetch", given, None if rule == "refuse" else rule)
    if rule == "recorded":
        assert line["from"] == {"run": load_verified(parent).run, "seq": 3}
    # a replay of the new run gives the model the policy's answer again
    replays_whole(proxy, out, Agent(changed=(2,),
                                    tools={"search": search, "fetch": lambda url: "LIVE PAGE"}))


def test_a_run_that_never_leaves_is_copied_whole_and_sends_nothing(
        proxy: Proxy, stub: Stub, parent: Path, recorded: Recorded, tmp_path: Path) -> None:
    live = stub(SCRIPT)
    out = tmp_path / "same.jsonl"
    p = then_live(proxy, parent, live, "-o", str(out))
    agent = Agent()
    agent.run(p.url)
    log = stop(p)
    assert live.requests == []
    assert agent.bodies == recorded.bodies
    assert "served 5 step(s)" in log and "never left it: nothing went live" in log, log
    new = load_verified(out)
    assert "step" not in new.header["parent"]
    assert kinds(new) == kinds(load_verified(parent))


def test_then_live_takes_its_options_together(tmp_path: Path, parent: Path) -> None:
    for args, said in [
        (["--then", "live"], "--then live goes with --replay CASSETTE"),
        (["--replay", str(parent), "--tool", "fetch=refuse"], "--tool and --live-tool go "
                                                                "with --replay"),
        (["--replay", str(parent), "-o", "x.jsonl"], "-o also with --replay CASSETTE "
                                                      "--then live"),
        (["--replay", str(parent), "--then", "live", "--tool", "fetch=maybe"],
         "the rule is one of live, recorded, refuse or static:JSON"),
    ]:
        done = run_proxy(tmp_path, *args)
        assert done.returncode == 2, done.stderr
        assert said in done.stderr, done.stderr


AGENT_SCRIPT = f"""
import os, anthropic
print(os.environ["DEJA_MODE"], "ANTHROPIC_API_KEY" in os.environ)
with anthropic.Anthropic(api_key="sk-test", max_retries=0) as client:
    reply = client.messages.create(model={MODEL!r}, max_tokens=99, tools={TOOLS!r},
                                   messages=[{{"role": "user", "content": "Find y"}}])
print(reply.content[0].text)
"""


def test_a_command_run_through_a_replay_then_live_proxy_is_in_a_fork(
        stub: Stub, parent: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """How deja replay takes a proxied run: the proxy started for the command goes live
    with the command's own key (no placeholder), and the command finds DEJA_MODE=fork."""
    from deja.cli_proxy import through_proxy

    live = stub(SCRIPT)
    (tmp_path / "agent.py").write_text(AGENT_SCRIPT)
    out = tmp_path / "new.jsonl"
    code = through_proxy(["--replay", str(parent), "--then", "live", "--upstream", live.url,
                          "-o", str(out)], [sys.executable, "agent.py"], tmp_path)
    said = capfd.readouterr()
    assert code == 0, said.err
    assert said.out.split() == ["fork", "False", "Searching."]
    assert len(live.requests) == 1
    assert "left it at step 0 (model, changed request)" in said.err
    assert load_verified(out).header["parent"]["step"] == 0


def test_deja_replay_then_stub_takes_a_proxied_run_through_the_proxy(
        parent: Path, tmp_path: Path) -> None:
    """deja replay C --then stub SCRIPT of a run recorded through the proxy: the program
    talks to a replay-then-live proxy whose upstream is the stub, into -o."""
    import os
    import subprocess

    (tmp_path / "agent.py").write_text(AGENT_SCRIPT)
    (tmp_path / "fix.stub.json").write_text(json.dumps(
        {"model": MODEL, "default": {"text": "from the stub"}}))
    ran = subprocess.run([sys.executable, "-m", "deja", "replay", str(parent), "--then", "stub",
                          "fix.stub.json", "-o", "new.jsonl", "--", sys.executable, "agent.py"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items()
                              if k != "ANTHROPIC_BASE_URL"})
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split()[-3:] == ["from", "the", "stub"]
    assert "recorded through deja proxy" in ran.stderr  # its tools run in the agent
    new = load_verified(tmp_path / "new.jsonl")
    assert new.header["parent"]["step"] == 0 and new.header["parent"]["mode"] == "then_live"


# -- the TypeScript SDK agent --------------------------------------------------------------


def test_the_node_agent_is_served_then_goes_live(proxy: Proxy, stub: Stub,
                                                 tmp_path: Path) -> None:
    ensure_node_modules()
    upstream = stub(json.loads(STUB_SCRIPT.read_text(encoding="utf-8")))
    recording = proxy("--upstream", upstream.url, "--dir", str(tmp_path / "runs"))
    dump = tmp_path / "record.dump"
    assert node_agent("--dump", str(dump),
                      env={"ANTHROPIC_BASE_URL": recording.url}).returncode == 0
    stop(recording)
    [parent] = cassettes(tmp_path / "runs")
    seen = len(upstream.requests)

    # the same agent: every stream served as recorded, nothing sent
    same = then_live(proxy, parent, upstream, "-o", str(tmp_path / "same.jsonl"))
    served = tmp_path / "same.dump"
    run = node_agent("--dump", str(served), env={"ANTHROPIC_BASE_URL": same.url})
    assert run.returncode == 0 and run.stdout.strip() == STUB_ANSWER, run.stderr
    assert "never left it" in stop(same)
    assert [d["body"] for d in read_dump(served)] == [d["body"] for d in read_dump(dump)]
    assert len(upstream.requests) == seen

    # another question: the first request goes live, and so does the rest
    other = then_live(proxy, parent, upstream, "-o", str(tmp_path / "other.jsonl"))
    run = node_agent("What's the weather in Cairo, in Fahrenheit?",
                     env={"ANTHROPIC_BASE_URL": other.url})
    assert run.returncode == 0, run.stderr
    assert "left it at step 0 (model, changed request): " in stop(other)
    assert len(upstream.requests) == seen + 3
    new = load_verified(tmp_path / "other.jsonl")
    assert new.header["parent"]["step"] == 0
    assert [o["name"] for o in lines(new) if o["kind"] == "tool"] == ["get_weather", "convert"]
