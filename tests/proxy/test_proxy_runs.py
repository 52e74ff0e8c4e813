"""Which run a proxied request belongs to: the pieces of proxy/runs.py, then the rule end
to end, through a real ``deja proxy`` process, with the Python anthropic SDK against the
stub server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anthropic
import httpx2
import pytest
from proxy_helpers import ProxyProcess, cassettes

from deja.proxy.runs import (
    ProxyRun,
    Registry,
    credential,
    message_keys,
    parse_labels,
    tool_calls,
    tool_results,
)
from recorder.cassette import load
from recorder.testing.server import StubServer

MODEL = "claude-sonnet-4-6"
KEY_A = "sk-ant-test-SECRET-4f1c9e"
KEY_B = "sk-ant-test-OTHER-77ab20"

Proxy = Callable[..., ProxyProcess]
Stub = Callable[[dict], StubServer]


# =================================================================== proxy/runs.py, unit


class _Session:
    """Enough of a session for a ProxyRun: a run id."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id


def _run(run_id: str, who: str = "a", keys: list[str] | None = None, *,
         name: str | None = None, failed: bool = False, used: float = 0.0,
         in_flight: int = 0) -> ProxyRun:
    run = ProxyRun(_Session(run_id), name=name, who=who)  # type: ignore[arg-type]
    run.last_keys = list(keys or [])
    run.last_failed = failed
    run.used = used
    run.in_flight = in_flight
    return run


def test_credential_is_a_hash_of_the_api_key_headers_only() -> None:
    a = credential([("x-api-key", KEY_A), ("content-type", "application/json")])
    assert a == credential([("X-Api-Key", KEY_A)])  # header names in any case
    assert a == credential([("x-api-key", KEY_A), ("x-deja-run", "n"), ("accept", "*/*")])
    assert a != credential([("x-api-key", KEY_B)])
    assert a != credential([("authorization", KEY_A)])  # which header counts too
    bearer = credential([("authorization", f"Bearer {KEY_A}")])
    assert bearer != a and bearer == credential([("Authorization", f"Bearer {KEY_A}")])
    assert credential([]) == credential([("accept", "*/*")])  # no key: one anonymous caller
    gemini = credential([("x-goog-api-key", KEY_A)])  # Gemini's clients: kept apart too
    assert gemini != credential([]) and gemini != credential([("x-goog-api-key", KEY_B)])
    for value in (a, bearer):
        assert len(value) == 16 and int(value, 16) >= 0
        assert "SECRET" not in value and KEY_A not in value


def test_parse_labels() -> None:
    assert parse_labels("team=core, ticket = T-1 ,owner=ana") == {
        "team": "core", "ticket": "T-1", "owner": "ana"}
    assert parse_labels(None) == {} and parse_labels("") == {}
    assert parse_labels("novalue, =orphan, k=, a=b=c") == {"k": "", "a": "b=c"}
    assert parse_labels("x=1, x=2") == {"x": "2"}


def test_message_keys_by_exact_text_else_by_json() -> None:
    m1 = {"role": "user", "content": "hi"}
    m2 = {"role": "assistant", "content": [{"type": "text", "text": "hello"}]}
    keys = message_keys([m1, m2])
    assert len(keys) == 2 and keys[0] != keys[1]
    assert message_keys([m1]) == keys[:1]  # a conversation's history keeps its keys
    # Without the texts, the JSON decides, whatever the order of its keys.
    assert message_keys([{"content": "hi", "role": "user"}]) == keys[:1]
    assert message_keys([{"role": "user", "content": "hi!"}]) != keys[:1]
    # With the body's texts, the bytes decide: the same message spelt another way differs.
    t1, t1_spaced = '{"role":"user","content":"hi"}', '{"role": "user", "content": "hi"}'
    by_text = message_keys([m1], [t1])
    assert by_text == message_keys([m1], [t1])
    assert by_text != message_keys([m1], [t1_spaced])
    # Texts that do not line up with the messages are not used.
    assert message_keys([m1, m2], [t1]) == keys
    assert all(len(k) == 24 for k in keys + by_text)


def test_tool_calls_and_tool_results() -> None:
    messages: list[Any] = [
        {"role": "user", "content": "find x"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "looking"},
            {"type": "tool_use", "id": "toolu_1", "name": "search", "input": {"q": "x"}},
            {"type": "tool_use", "id": "toolu_2", "name": "fetch", "input": {"url": "u"}},
            {"type": "tool_use", "id": 7, "name": "bad id"},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "found"},
            {"type": "text", "text": "and"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": "page",
             "is_error": True},
            {"type": "tool_result", "tool_use_id": None, "content": "no id"},
        ]},
        # a tool_use in a user message, a tool_result in an assistant one: neither counts
        {"role": "user", "content": [{"type": "tool_use", "id": "toolu_u", "name": "n"}]},
        {"role": "assistant", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_a", "content": "?"}]},
        "not a message",
        {"role": "assistant", "content": "plain text"},
    ]
    assert tool_calls(messages) == {"toolu_1": ("search", {"q": "x"}),
                                    "toolu_2": ("fetch", {"url": "u"})}
    results = tool_results(messages)
    assert [r["tool_use_id"] for r in results] == ["toolu_1", "toolu_2"]
    assert results[1]["is_error"] is True
    assert tool_calls([]) == {} and tool_results([]) == []


def test_end_status_of_a_run() -> None:
    run = _run("r_1")
    assert run.end_status()[0] == "interrupted"  # no response yet
    run.last_stop_reason = "tool_use"
    assert run.end_status()[0] == "interrupted"
    run.last_stop_reason = "end_turn"
    assert run.end_status() == ("completed", None)
    run.last_stop_reason = "max_tokens"
    assert run.end_status()[0] == "completed"
    run.last_failed = True
    assert run.end_status()[0] == "error"
    assert run.run_id == "r_1"


def test_registry_finds_a_run_by_name_per_api_key() -> None:
    reg = Registry()
    named = _run("r_n", "a", name="job-1")
    reg.add(named)
    assert len(reg) == 1
    assert reg.find("a", "job-1", None) is named
    assert reg.find("b", "job-1", None) is None  # another key: another run
    assert reg.find("a", "job-2", None) is None
    # A named run is never found by its history.
    named.last_keys = ["k1"]
    assert reg.find("a", None, ["k1", "k2"]) is None
    reg.retire(named, keep=False)
    assert reg.find("a", "job-1", None) is None and len(reg) == 0


def test_registry_finds_a_conversation_by_its_history() -> None:
    reg = Registry()
    one = _run("r_1", "a", ["k1", "k2"], used=1.0)
    two = _run("r_2", "a", ["k1", "k2", "k3", "k4"], used=2.0)
    other = _run("r_3", "b", ["k1", "k2", "k3", "k4"], used=3.0)
    for run in (one, two, other):
        reg.add(run)
    # An extension joins the longest run it extends, of its own key only.
    assert reg.find("a", None, ["k1", "k2", "x"]) is one
    assert reg.find("a", None, ["k1", "k2", "k3", "k4", "k5"]) is two
    assert reg.find("b", None, ["k1", "k2", "k3", "k4", "k5"]) is other
    assert reg.find("c", None, ["k1", "k2", "k3", "k4", "k5"]) is None
    # Another history: a new run.
    assert reg.find("a", None, ["k9"]) is None
    assert reg.find("a", None, ["k1"]) is None  # shorter than every run
    # The same request again after a success is a new conversation; after a failure, a retry.
    assert reg.find("a", None, ["k1", "k2"]) is None
    one.last_failed = True
    assert reg.find("a", None, ["k1", "k2"]) is one
    # Not a model call: the key's most recently used run.
    assert reg.find("a", None, None) is two
    one.used = 5.0
    assert reg.find("a", None, None) is one
    assert reg.find("z", None, None) is None


def test_registry_prefers_an_idle_run_then_the_latest_among_equals() -> None:
    reg = Registry()
    busy = _run("r_busy", "a", ["k1"], used=9.0, in_flight=1)
    old = _run("r_old", "a", ["k1"], used=1.0)
    new = _run("r_new", "a", ["k1"], used=2.0)
    for run in (busy, old, new):
        reg.add(run)
    assert reg.find("a", None, ["k1", "k2"]) is new
    new.in_flight = 1
    assert reg.find("a", None, ["k1", "k2"]) is old
    old.in_flight = 1
    assert reg.find("a", None, ["k1", "k2"]) is busy


def test_registry_keeps_a_stopped_run_for_its_client() -> None:
    reg = Registry()
    run = _run("r_s", "a", ["k1", "k2"], used=1.0)
    named = _run("r_sn", "a", name="job", used=1.0)
    reg.add(run)
    reg.add(named)
    run.stopped = named.stopped = RuntimeError("stopped")  # type: ignore[assignment]
    reg.retire(run, keep=True)
    reg.retire(named, keep=True)
    assert len(reg) == 0 and reg.open_runs() == []
    # The stopped conversation is still found by the request it refused (which extends
    # its last answered one), and by that request sent again, or with more history.
    assert reg.find("a", None, ["k1", "k2", "k3"]) is run
    assert reg.find("a", None, ["k1", "k2", "k3", "k4", "k5"]) is run
    assert reg.find("a", "job", None) is named
    assert reg.find("b", None, ["k1", "k2", "k3"]) is None
    reg.forget_stopped(older_than=0.5)  # not old enough yet
    assert reg.find("a", None, ["k1", "k2", "k3"]) is run
    reg.forget_stopped(older_than=2.0)
    assert reg.find("a", None, ["k1", "k2", "k3"]) is None
    assert reg.find("a", "job", None) is None


def test_registry_idle_lists_runs_with_nothing_in_flight() -> None:
    reg = Registry()
    quiet = _run("r_q", used=1.0)
    busy = _run("r_b", used=1.0, in_flight=1)
    fresh = _run("r_f", used=10.0)
    for run in (quiet, busy, fresh):
        reg.add(run)
    assert reg.idle(5.0) == [quiet]
    assert reg.idle(0.5) == []
    assert {r.run_id for r in reg.open_runs()} == {"r_q", "r_b", "r_f"}


# ========================================================= the run rule, end to end


@dataclass
class Turn:
    """One answered model request as the client saw it."""

    run_id: str
    message: Any
    status: int = 200


@dataclass
class Conversation:
    """A minimal tool-using agent loop over a real SDK client."""

    client: anthropic.Anthropic
    prompt: str
    stream: bool = False
    headers: dict[str, str] = field(default_factory=dict)
    messages: list[dict[str, Any]] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.messages = [{"role": "user", "content": self.prompt}]

    def ask(self) -> Turn:
        """Send the conversation so far; add the reply (and its tool results) to it."""
        params: dict[str, Any] = {"model": MODEL, "max_tokens": 256,
                                  "messages": self.messages, "extra_headers": self.headers}
        if self.stream:
            with self.client.messages.stream(**params) as s:
                message = s.get_final_message()
                turn = Turn(s.response.headers["x-deja-run-id"], message)
        else:
            raw = self.client.messages.with_raw_response.create(**params)
            turn = Turn(raw.headers["x-deja-run-id"], raw.parse())
        self.turns.append(turn)
        self.messages = [*self.messages, {"role": "assistant", "content": [
            b.model_dump(mode="json", exclude_none=True) for b in turn.message.content]}]
        uses = [b for b in turn.message.content if b.type == "tool_use"]
        if uses:
            self.messages = [*self.messages, {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": b.id,
                 "content": f"{b.name} result for {self.prompt}"} for b in uses]}]
        return turn

    def run(self, limit: int = 6) -> list[Turn]:
        """Ask until the model ends its turn."""
        for _ in range(limit):
            if self.ask().message.stop_reason != "tool_use":
                break
        return self.turns

    @property
    def run_ids(self) -> set[str]:
        return {t.run_id for t in self.turns}


TOOL_LOOP = {  # search, then fetch, then an answer: a conversation of three model calls
    "model": MODEL, "select": "conversation",
    "turns": [{"text": "Searching.", "tool_use": {"name": "search", "input": {"q": "x"}}},
              {"text": "Fetching.", "tool_use": {"name": "fetch", "input": {"url": "u"}}},
              {"text": "Done: {echo}"}]}


@pytest.fixture
def clients() -> Iterator[Callable[..., anthropic.Anthropic]]:
    made: list[anthropic.Anthropic] = []

    def make(url: str, api_key: str = KEY_A, max_retries: int = 0,
             http_client: httpx2.Client | None = None) -> anthropic.Anthropic:
        client = anthropic.Anthropic(base_url=url, api_key=api_key, max_retries=max_retries,
                                     http_client=http_client)
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


def start(proxy: Proxy, stub: StubServer, tmp_path: Path, *args: str) -> ProxyProcess:
    return proxy("--upstream", stub.url, "--dir", str(tmp_path / "runs"), *args)


def stop(p: ProxyProcess) -> str:
    code, log = p.stop()
    assert code == 0, log
    return log


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def by_run(directory: Path) -> dict[str, Any]:
    """Every cassette of ``directory``, loaded and verified, by run id."""
    out = {}
    for path in cassettes(directory):
        c = load(path, require_signature=True)
        assert c.verified, c.verify_note
        assert path.name == f"{c.run}.jsonl"
        out[c.run] = c
    return out


def first_prompts(cassette: Any) -> set[str]:
    """The first user message of every model request of a cassette."""
    return {cassette.request_of(o["seq"])["messages"][0]["content"]
            for o in cassette.observations if o["kind"] == "model"}


def kinds(cassette: Any) -> list[str]:
    return [o["kind"] for o in cassette.observations]


def deja(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "deja", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "COLUMNS": "250"})


def wait_for(predicate: Callable[[], Any], timeout: float = 10.0, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what or predicate}")


def test_a_conversations_turns_share_one_run(proxy: Proxy, stub: Stub, tmp_path: Path,
                                             clients: Callable[..., anthropic.Anthropic]
                                             ) -> None:
    p = start(proxy, stub(TOOL_LOOP), tmp_path)
    talk = Conversation(clients(p.url), "plan the trip", stream=True)
    turns = talk.run()
    assert [t.message.stop_reason for t in turns] == ["tool_use", "tool_use", "end_turn"]
    assert len(talk.run_ids) == 1
    stop(p)
    runs = by_run(tmp_path / "runs")
    assert list(runs) == [turns[0].run_id]
    c = runs[turns[0].run_id]
    assert kinds(c) == ["model", "tool", "model", "tool", "model"]
    assert [o["name"] for o in c.observations if o["kind"] == "tool"] == ["search", "fetch"]
    assert c.end is not None and c.end["status"] == "completed"


def test_two_conversations_of_one_client_are_two_runs(
        proxy: Proxy, stub: Stub, tmp_path: Path,
        clients: Callable[..., anthropic.Anthropic]) -> None:
    p = start(proxy, stub(TOOL_LOOP), tmp_path)
    client = clients(p.url)
    one, two = Conversation(client, "task one"), Conversation(client, "task two")
    for _ in range(3):  # interleaved, turn by turn
        one.ask()
        two.ask()
    # The same task once more, after the first run of it ended: a run of its own too.
    again = Conversation(client, "task one")
    again.run()
    assert len(one.run_ids) == len(two.run_ids) == len(again.run_ids) == 1
    assert len(one.run_ids | two.run_ids | again.run_ids) == 3
    stop(p)
    runs = by_run(tmp_path / "runs")
    assert set(runs) == one.run_ids | two.run_ids | again.run_ids
    for talk in (one, two, again):
        c = runs[talk.turns[0].run_id]
        assert first_prompts(c) == {talk.prompt}
        assert kinds(c) == ["model", "tool", "model", "tool", "model"]


def test_many_open_runs_share_the_proxys_threads(
        proxy: Proxy, stub: Stub, tmp_path: Path,
        clients: Callable[..., anthropic.Anthropic]) -> None:
    """A run starts no thread of its own: its group commit and its status record are
    chores of the process's one background thread, so a proxy holding many runs open has
    a few threads, not two a run (each would cost the event loop a start and compete for
    the interpreter)."""
    p = start(proxy, stub(TOOL_LOOP), tmp_path)
    client = clients(p.url)
    talks = [Conversation(client, f"task {i}") for i in range(24)]
    for talk in talks:
        talk.ask()  # each a run of its own, left open (idle for 300 s before it closes)
    assert len(set().union(*(t.run_ids for t in talks))) == 24
    threads = len(list(Path(f"/proc/{p.pid}/task").iterdir()))
    assert threads < 12  # the event loop, the executor's few workers, the background one
    for talk in talks:
        talk.run()
    stop(p)
    runs = by_run(tmp_path / "runs")
    assert len(runs) == 24
    assert all(c.end is not None and c.end["status"] == "completed" for c in runs.values())


def test_named_runs_group_requests(proxy: Proxy, stub: Stub, tmp_path: Path,
                                   clients: Callable[..., anthropic.Anthropic]) -> None:
    server = stub(TOOL_LOOP)
    # Two conversations in one run call the same tools in turn: not a loop here.
    p = start(proxy, server, tmp_path, "--no-loop-guard")
    client = clients(p.url)
    talks = [Conversation(client, f"job {i}", headers={"x-deja-run": name})
             for i, name in enumerate(["batch-a", "batch-a", "batch-b"])]
    for talk in talks:
        talk.run()
    a, b = talks[0].run_ids | talks[1].run_ids, talks[2].run_ids
    assert len(a) == 1 and len(b) == 1 and a != b
    # A run name the proxy does not take is refused, before anything is forwarded.
    served = len(server.received())
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model=MODEL, max_tokens=8, messages=[
            {"role": "user", "content": "x"}], extra_headers={"x-deja-run": "no spaces!"})
    assert "x-deja-run" in str(err.value)
    assert len(server.received()) == served
    stop(p)
    runs = by_run(tmp_path / "runs")
    assert set(runs) == a | b
    (ra,), (rb,) = a, b
    assert first_prompts(runs[ra]) == {"job 0", "job 1"}
    assert first_prompts(runs[rb]) == {"job 2"}
    assert runs[ra].header["proxy"]["name"] == "batch-a"
    assert runs[rb].header["proxy"]["name"] == "batch-b"
    assert kinds(runs[ra]).count("model") == 6


def test_another_api_key_never_joins_a_run(proxy: Proxy, stub: Stub, tmp_path: Path,
                                           clients: Callable[..., anthropic.Anthropic]
                                           ) -> None:
    p = start(proxy, stub(TOOL_LOOP), tmp_path)
    alice = Conversation(clients(p.url, KEY_A), "shared task")
    alice.ask()
    # Bob sends Alice's very next request, word for word, with his own key.
    bob = Conversation(clients(p.url, KEY_B), "shared task")
    bob.messages = list(alice.messages)
    bob.ask()
    alice.ask()
    assert len(alice.run_ids) == 1 and len(bob.run_ids) == 1
    assert alice.run_ids != bob.run_ids
    # The same run name under two keys: two runs.
    named = [Conversation(clients(p.url, key), f"named {key[-4:]}",
                          headers={"x-deja-run": "nightly"}) for key in (KEY_A, KEY_B)]
    for talk in named:
        talk.ask()
    assert named[0].run_ids != named[1].run_ids
    stop(p)
    runs = by_run(tmp_path / "runs")
    assert len(runs) == 4
    (ra,), (rb,) = alice.run_ids, bob.run_ids
    assert kinds(runs[ra]).count("model") == 2 and kinds(runs[rb]).count("model") == 1
    for c in runs.values():  # the key itself is never written
        assert KEY_A not in c.path.read_text() and KEY_B not in c.path.read_text()


def test_an_sdk_retry_after_a_529_stays_in_its_run(
        proxy: Proxy, stub: Stub, tmp_path: Path,
        clients: Callable[..., anthropic.Anthropic]) -> None:
    server = stub({"model": MODEL, "select": "conversation", "turns": [
        {"error": {"status": 529, "retry_after": 0}, "then": [{"text": "ok"}]},
        {"text": "fine"}]})
    p = start(proxy, server, tmp_path)
    with httpx2.Client(timeout=30) as hc:
        talk = Conversation(clients(p.url, max_retries=2, http_client=hc), "flaky")
        assert talk.ask().message.content[0].text == "ok"
        talk.messages.append({"role": "user", "content": "and then?"})
        assert talk.ask().message.content[0].text == "fine"
    attempts = [r["headers"].get("x-stainless-retry-count") for r in server.received()]
    assert attempts == ["0", "1", "0"]  # the SDK did retry the 529
    assert len(talk.run_ids) == 1
    stop(p)
    runs = by_run(tmp_path / "runs")
    assert set(runs) == talk.run_ids
    c = runs[talk.turns[0].run_id]
    assert [o["response"]["status"] for o in c.observations if o["kind"] == "model"] == \
        [529, 200, 200]


def test_an_idle_run_is_closed_with_its_end_line(
        proxy: Proxy, stub: Stub, tmp_path: Path,
        clients: Callable[..., anthropic.Anthropic]) -> None:
    p = start(proxy, stub(TOOL_LOOP), tmp_path, "--idle", "0.3")
    client = clients(p.url)
    done = Conversation(client, "finish this")
    done.run()
    left = Conversation(client, "walk away")
    left.ask()  # a tool_use, and no request after it
    (done_id,), (left_id,) = done.run_ids, left.run_ids
    paths = [tmp_path / "runs" / f"{run}.jsonl" for run in (done_id, left_id)]

    def ended() -> bool:
        return all(lines(path)[-1]["kind"] == "end" for path in paths)

    wait_for(ended, what="the idle runs' end lines")
    assert p.process.poll() is None  # closed by the idle timer, not by a shutdown
    assert lines(paths[0])[-1]["status"] == "completed"
    assert lines(paths[1])[-1]["status"] == "interrupted"
    health = httpx2.get(f"{p.url}/_deja/health").json()
    assert health["runs_open"] == 0 and health["ok"] is True
    # A request after the close starts a new run (the old one is not written again).
    left.ask()
    assert len(left.run_ids) == 2
    log = stop(p)
    assert "idle for 0.3s" in log
    for c in by_run(tmp_path / "runs").values():
        assert c.end is not None


def test_labels_and_the_run_id_header(proxy: Proxy, stub: Stub, tmp_path: Path,
                                      clients: Callable[..., anthropic.Anthropic]) -> None:
    p = start(proxy, stub(TOOL_LOOP), tmp_path, "--label", "team=core")
    client = clients(p.url)
    labelled = Conversation(client, "labelled",
                            headers={"x-deja-labels": "ticket=T-1, owner = ana"})
    labelled.run()
    plain = Conversation(client, "plain", stream=True)
    plain.run()
    stop(p)
    runs = by_run(tmp_path / "runs")
    (rl,), (rp,) = labelled.run_ids, plain.run_ids
    assert set(runs) == {rl, rp}
    assert runs[rl].header["labels"] == {"team": "core", "ticket": "T-1", "owner": "ana"}
    assert runs[rp].header["labels"] == {"team": "core"}
    # Each response named the run whose cassette holds it: the message ids match.
    for talk in (labelled, plain):
        c = runs[talk.turns[0].run_id]
        assert [o["message_id"] for o in c.observations if o["kind"] == "model"] == \
            [t.message.id for t in talk.turns]


def test_deja_ls_and_status_show_proxied_runs(
        proxy: Proxy, stub: Stub, tmp_path: Path,
        clients: Callable[..., anthropic.Anthropic]) -> None:
    p = start(proxy, stub(TOOL_LOOP), tmp_path)
    talk = Conversation(clients(p.url), "status please",
                        headers={"x-deja-labels": "suite=proxy"})
    talk.ask()
    (run_id,) = talk.run_ids
    # While the run is open: running, in the proxy's process, writing its cassette.
    live = json.loads(deja("status", run_id, "--json", cwd=tmp_path).stdout)
    assert live["run_id"] == run_id and live["status"] == "running"
    assert live["pid"] == p.pid
    assert [Path(a).name for a in live["artefacts"]] == [f"{run_id}.jsonl"]
    talk.run()
    other = Conversation(clients(p.url), "second run")
    other.run()
    assert len(talk.run_ids) == 1
    stop(p)  # every open run gets its end line
    status = deja("status", run_id, "--json", cwd=tmp_path)
    assert status.returncode == 0, status.stderr
    record = json.loads(status.stdout)
    assert record["status"] == "completed" and record["ended"] is True
    assert record["totals"]["model_calls"] == 3 and record["totals"]["tool_calls"] == 2
    listed = deja("ls", str(tmp_path / "runs"), "--json", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    rows = {row["run"]: row for row in json.loads(listed.stdout)}
    assert set(rows) == talk.run_ids | other.run_ids
    assert rows[run_id]["status"] == "completed" and rows[run_id]["verified"] is True
    assert rows[run_id]["model_calls"] == 3 and rows[run_id]["labels"] == {"suite": "proxy"}
    table = deja("ls", str(tmp_path / "runs"), cwd=tmp_path)
    assert table.returncode == 0 and run_id in table.stdout
    assert next(iter(other.run_ids)) in table.stdout


def test_an_sdk_retry_after_a_timeout_stays_in_its_run(proxy: Proxy, stub: Stub,
                                                       tmp_path: Path) -> None:
    """The SDK gives up on a slow attempt and sends the same request again while the
    first one is still in flight at the proxy: a retry all the same."""
    server = stub({"model": MODEL, "select": "conversation", "turns": [
        {"text": "first"},
        {"error": {"status": 500}, "delay_ms": 2500, "then": [{"text": "second"}]},
        {"text": "third"}]})
    p = start(proxy, server, tmp_path)
    client = anthropic.Anthropic(base_url=p.url, api_key=KEY_A, max_retries=2, timeout=30)
    with client:
        talk = Conversation(client, "slow upstream")
        for follow_up, timeout in (("go on", 30.0), ("and?", 0.5), (None, 30.0)):
            talk.client = client.with_options(timeout=timeout)
            talk.ask()
            if follow_up:
                talk.messages.append({"role": "user", "content": follow_up})
    assert [t.message.content[0].text for t in talk.turns] == ["first", "second", "third"]
    # The second request was sent twice: it timed out at the client, then was retried.
    assert [r["headers"].get("x-stainless-retry-count") for r in server.received()][:3] == \
        ["0", "0", "1"]
    assert len(talk.run_ids) == 1, [t.run_id for t in talk.turns]
    stop(p)
    assert len(cassettes(tmp_path / "runs")) == 1


def test_a_new_conversation_like_a_stopped_one_gets_its_own_run(
        proxy: Proxy, stub: Stub, tmp_path: Path,
        clients: Callable[..., anthropic.Anthropic]) -> None:
    """An agent stopped by the loop guard is run again from the start against an upstream
    that answers the same way (fixed tool ids: a stub, a replayed model): the new run is
    its own, and the guard stops it at its own third repeat."""
    looping = [{"text": "Again.", "tool_use": {"name": "look", "input": {"p": 1},
                                               "id": f"toolu_fixed_{i}"}} for i in range(6)]
    p = start(proxy, stub({"model": MODEL, "select": "conversation", "turns": looping}),
              tmp_path)
    client = clients(p.url)
    runs: list[list[str]] = []
    for _ in range(2):
        talk = Conversation(client, "look again")
        with pytest.raises(anthropic.BadRequestError) as err:
            talk.run()
        assert err.value.response.headers["x-deja-stop"] == "loop_detected"
        runs.append([t.run_id for t in talk.turns] + [err.value.response.headers[
            "x-deja-run-id"]])
    first, second = runs
    assert first == [first[0]] * 4  # three answers, then the stop
    # The second conversation's third request repeats the first run's last answered
    # one byte for byte; it must not be refused as that (stopped) run.
    assert second == [second[0]] * 4, (first[0], second)
    assert first[0] != second[0]
    stop(p)
    for run in (first[0], second[0]):
        assert lines(tmp_path / "runs" / f"{run}.jsonl")[-1]["status"] == "stopped"
