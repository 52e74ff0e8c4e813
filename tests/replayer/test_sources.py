"""Who answers a call is data: a continuing run's sources and a recording's interceptors.

The real anthropic SDK against the stub server, real cassettes; the sessions are put
together from their parts as the fork and resume commands put them together, to show that
a new combination needs no new session class: a log that passes a miss on (replay, then
live) and an interceptor beside the run's guard.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import anthropic
import pytest
from conftest import MODEL, read_lines

import recorder
import replayer
from recorder.capture.exchange import HttpRequest
from recorder.capture.sources import Interceptor
from recorder.cassette import CassetteWriter, load
from recorder.cassette.keys import load_keyring
from recorder.errors import Divergence, RunStopped
from recorder.record import RecordSession
from recorder.testing.server import StubServer
from replayer.continuation import ContinuationSession
from replayer.replay import ReplaySession

PAID: list[str] = []


@recorder.tool(side_effect=True)
def pay(invoice: str) -> str:
    PAID.append(invoice)
    return f"paid {invoice}"


def agent(base_url: str, questions: list[str]) -> list[str]:
    """Ask each question in turn, paying an invoice after each answer."""
    client = anthropic.Anthropic(base_url=base_url, api_key="sk-stub", max_retries=0)
    said = []
    for n, question in enumerate(questions):
        reply = client.messages.create(model=MODEL, max_tokens=64,
                                       messages=[{"role": "user", "content": question}])
        said.append(reply.content[0].text)  # type: ignore[union-attr]
        said.append(pay(f"INV-{n}"))
    return said


@pytest.fixture
def recorded(stub: Any, tmp_path: Path) -> tuple[Path, StubServer]:
    server = stub({"default": {"text": "ok"}})
    PAID.clear()
    with recorder.record(tmp_path / "first.jsonl"):
        agent(server.url, ["one?", "two?"])
    assert PAID == ["INV-0", "INV-1"]
    return tmp_path / "first.jsonl", server


def replay_then_live(parent: Path, out: Path) -> ContinuationSession:
    """The parent's log, copied while the program asks what it asked before; at the first
    miss the log closes and calls go live, into ``out``."""
    loaded = load(parent)
    header = {k: v for k, v in loaded.header.items() if k not in ("format", "key_id", "run")}
    header.update(run="r_then_live", parent={"run": loaded.run, "path": str(parent)})
    ring = load_keyring()
    assert ring.signing is not None
    writer = CassetteWriter(out, header, ring.signing)
    empty = dataclasses.replace(loaded, observations=(), end=None)
    log = ReplaySession(loaded, on_miss="pass", copies=True)
    return ContinuationSession(empty, writer, sources=[log], mode="replay")


def test_a_log_that_passes_a_miss_on_serves_then_goes_live(
        recorded: tuple[Path, StubServer], tmp_path: Path) -> None:
    parent, server = recorded
    asked_before = server.served
    PAID.clear()
    out = tmp_path / "then-live.jsonl"
    session = replay_then_live(parent, out).start()
    try:
        said = agent(server.url, ["one?", "three?"])  # the second question is new
    finally:
        session.close()
    assert said == ["ok", "paid INV-0", "ok", "paid INV-1"]
    assert PAID == ["INV-1"]  # the recorded payment was served, not made again
    assert server.served - asked_before == 1  # only the new question reached the model
    lines = read_lines(out)
    kinds = [line["kind"] for line in lines[1:-1]]
    assert kinds == ["model", "intent", "outcome", "model", "intent", "outcome"], kinds
    assert lines[-1]["status"] == "completed"
    # The new cassette replays the changed program whole, offline.
    server.stop()
    with replayer.replay(out):
        assert agent(server.url, ["one?", "three?"]) == said
    with pytest.raises(Divergence), replayer.replay(out):  # the old program: not this run
        agent(server.url, ["one?", "two?"])


def test_a_log_that_diverges_is_not_passed_on(
        recorded: tuple[Path, StubServer], tmp_path: Path) -> None:
    parent, server = recorded
    session = replay_then_live(parent, tmp_path / "strict.jsonl")
    strict = ReplaySession(load(parent), copies=True)  # on_miss="diverge", the default
    session.sources = (session.prefix, strict)
    session.start()
    try:
        with pytest.raises(Divergence):
            agent(server.url, ["something else?"])
    finally:
        session.close()


class Counting(Interceptor):
    """Counts what it sees; stops the run at the ``stop_at``-th tool call."""

    def __init__(self, stop_at: int) -> None:
        self.calls: list[str] = []
        self.exchanges: list[int | None] = []
        self.tools: list[str] = []
        self.stop_at = stop_at

    def before_call(self, request: HttpRequest, provider: str | None) -> None:
        self.calls.append(f"{provider} {request.method}")

    def after_exchange(self, request: HttpRequest, *, model: bool, status: int | None,
                       error: BaseException | None, usage: dict[str, Any] | None,
                       cost: float | None) -> None:
        self.exchanges.append(status)

    def before_tool(self, name: str, args: Any) -> None:
        self.tools.append(name)
        if len(self.tools) == self.stop_at:
            raise RunStopped("stopped by a test interceptor", reason="test")


def test_an_interceptor_sees_every_call_beside_the_guard(stub: Any, tmp_path: Path) -> None:
    server = stub({"default": {"text": "ok"}})
    seen = Counting(stop_at=2)
    PAID.clear()
    session = RecordSession(tmp_path / "watched.jsonl", interceptors=(seen,)).start()
    with pytest.raises(RunStopped, match="test interceptor") as stopped:
        agent(server.url, ["one?", "two?"])
    session.close(error=stopped.value)
    assert session.interceptors[0] is session.guard and session.interceptors[1] is seen
    assert seen.calls == ["anthropic POST", "anthropic POST"]
    assert seen.exchanges == [200, 200]
    assert seen.tools == ["pay", "pay"]
    assert PAID == ["INV-0"]  # stopped before the second payment ran
    assert read_lines(tmp_path / "watched.jsonl")[-1]["status"] == "stopped"
