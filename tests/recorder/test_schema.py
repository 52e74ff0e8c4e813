"""The observation schema: its names match what deja writes, and its rules hold on real runs.

Runs are recorded in this process with the real anthropic SDK against the stub server: a
run with a retried 529, a tool and an effect; a run the loop guard stops; a run out of
budget; and a fork. What the writer wrote is read back raw (no reader in between) and
compared with :mod:`recorder.cassette.schema`.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import anthropic
import pytest
from conftest import MODEL, _collect_clients, read_lines

import recorder
import replayer
from recorder import errors
from recorder.cassette import KINDS, RESUMABLE_ENDS, load
from recorder.cassette.lines import Store
from recorder.cassette.reader import PEEK_CHUNK, peek_end, peek_header
from recorder.cassette.rows import (
    live_from,
    run_summary,
    run_totals,
    step_error,
    step_rows,
)
from recorder.cassette.schema import (
    BOOKKEEPING,
    STOPS,
    Control,
    EndStatus,
    Kind,
    add_step,
    control_event,
    error_of,
    is_bookkeeping,
    replayed_totals,
    run_file,
    totals_of,
    utc_stamp,
    zero_totals,
)
from recorder.harness.progress import cassette_end
from recorder.record import status_for
from recorder.testing.server import StubServer

TOOLS = [{"name": "find", "description": "Find files by query.",
          "input_schema": {"type": "object", "properties": {"query": {"type": "string"}},
                           "required": ["query"]}}]
FIND = {"text": "Searching.", "tool_use": {"name": "find", "input": {"query": "session"}},
        "usage": {"input_tokens": 120, "output_tokens": 20}}
DONE = {"text": "It is in auth/session.py.", "usage": {"input_tokens": 200, "output_tokens": 9}}
# The first call is refused once (529) and retried by the SDK.
RETRIED = {"select": "conversation", "turns": [
    {"error": {"status": 529, "retry_after": 0}, "then": [FIND]}, DONE]}
LOOPING = {"select": "conversation", "default": FIND}


@recorder.tool
def find(query: str) -> list[str]:
    recorder.uuid4()  # an effect inside the tool's body
    return ["auth/session.py"]


def agent(url: str, turns: int = 6, stream: bool = False) -> str:
    recorder.randint(0, 9)  # an effect outside any tool
    client = anthropic.Anthropic(base_url=url, api_key="sk-test", max_retries=1)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Where is refresh?"}]
    for _ in range(turns):
        if stream:
            with client.messages.stream(model=MODEL, max_tokens=64, tools=TOOLS,
                                        messages=messages) as events:
                reply = events.get_final_message()
        else:
            reply = client.messages.create(model=MODEL, max_tokens=64, tools=TOOLS,
                                           messages=messages)
        messages.append({"role": "assistant", "content": [
            b.model_dump(exclude_none=True) for b in reply.content]})
        if reply.stop_reason != "tool_use":
            return reply.content[0].text
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": b.id, "content": json.dumps(find(**b.input))}
            for b in reply.content if b.type == "tool_use"]})
    return "out of turns"


def record(path: Path, script: dict[str, Any], **options: Any) -> Path:
    with StubServer(script) as server:
        try:
            with recorder.record(path, **options):
                agent(server.url)
        except errors.RunStopped:
            pass
    _collect_clients()
    return path


@pytest.fixture
def retried(tmp_path: Path) -> Path:
    return record(tmp_path / "retried.jsonl", RETRIED)


@pytest.fixture
def looped(tmp_path: Path) -> Path:
    return record(tmp_path / "looped.jsonl", LOOPING)


@pytest.fixture
def exhausted(tmp_path: Path) -> Path:
    return record(tmp_path / "exhausted.jsonl", LOOPING, budgets={"turns": 1},
                  loop_guard=False)


# -- the names are what the writer writes


def test_kinds_keep_the_format_order() -> None:
    assert KINDS == ("model", "http", "tool", "mcp", "intent", "outcome", "effect", "control",
                     "end")
    assert KINDS == tuple(Kind)
    assert all(type(k) is str for k in KINDS)
    assert RESUMABLE_ENDS == {EndStatus.INTERRUPTED, EndStatus.NEEDS_ATTENTION} \
        == {"interrupted", "needs_attention"}


def test_every_line_written_has_a_known_kind_status_and_event(
        retried: Path, looped: Path, exhausted: Path) -> None:
    seen_kinds: set[str] = set()
    events: set[str] = set()
    ends: dict[str, str] = {}
    for path in (retried, looped, exhausted):
        lines = read_lines(path)
        for line in lines[1:]:
            assert Kind(line["kind"]) == line["kind"]
            seen_kinds.add(line["kind"])
            if line["kind"] == Kind.CONTROL:
                events.add(Control(line["event"]))
        ends[path.stem] = EndStatus(lines[-1]["status"])
    assert {Kind.MODEL, Kind.TOOL, Kind.EFFECT, Kind.CONTROL, Kind.END} <= seen_kinds
    assert {Control.LOOP_DETECTED, Control.BUDGET_EXHAUSTED} <= events <= STOPS
    assert ends == {"retried": EndStatus.COMPLETED, "looped": EndStatus.STOPPED,
                    "exhausted": EndStatus.EXHAUSTED}


def test_every_end_status_deja_can_write_is_named() -> None:
    stops = [errors.RunStopped, errors.NeedsAttention, errors.BudgetExhausted,
             errors.Cancelled, errors.LoopDetected, errors.CircuitOpen]
    written = {status_for(cls("x")) for cls in stops}
    written |= {status_for(None), status_for(ValueError()), status_for(KeyboardInterrupt())}
    assert written == set(EndStatus)


def test_a_fork_writes_a_bookkeeping_line_and_nothing_else_is_one(
        retried: Path, tmp_path: Path) -> None:
    tool = next(line["seq"] for line in read_lines(retried) if line.get("kind") == "tool")
    out = tmp_path / "fork.jsonl"
    with StubServer(RETRIED) as server:
        with replayer.fork(retried, at=tool, out=out, sets=['result=["auth/token.py"]']):
            agent(server.url)
    _collect_clients()
    fork = load(out)
    marks = [obs for obs in fork.observations if is_bookkeeping(obs)]
    assert [control_event(obs) for obs in marks] == [Control.FORK_EDIT]
    assert BOOKKEEPING == {"fork_edit", "resumed", "sending", "continues"}
    assert live_from(fork) == marks[0]["seq"] + 1
    assert not any(is_bookkeeping(obs) for obs in load(retried).observations)
    assert control_event({"kind": "tool", "event": "fork_edit"}) is None
    # the end line says what was replayed, by the same rule
    replayed = [obs for obs in fork.observations if obs["seq"] < live_from(fork)]
    assert fork.end is not None
    assert fork.end["totals"]["replayed"] == replayed_totals(replayed)


# -- one rule for totals


def _counts(t: dict[str, Any]) -> dict[str, Any]:
    return {k: t[k] for k in zero_totals()}


def test_the_end_line_counts_what_the_readers_count(
        retried: Path, looped: Path, exhausted: Path) -> None:
    for path in (retried, looped, exhausted):
        cassette = load(path)
        assert cassette.end is not None
        written = cassette.end["totals"]
        counted = totals_of(cassette.observations)
        assert _counts(written) == _counts(counted), path.stem
        assert written["observations"] == counted["steps"] == len(cassette.observations)
        summary = run_summary(cassette)
        assert _counts(summary) == _counts(counted)
        assert run_totals(cassette)["all"] == counted
    retried_totals = totals_of(load(retried).observations)
    assert retried_totals["model_calls"] == 3 and retried_totals["errors"] == 1  # the 529
    assert retried_totals["tool_calls"] == 1 and retried_totals["effects"] == 2
    assert retried_totals["input_tokens"] == 320 and retried_totals["output_tokens"] == 29


def test_totals_count_each_line_as_restored_whole(retried: Path, tmp_path: Path) -> None:
    """run_totals reads a model line without its request: it counts what the lines
    restored whole count, for a streamed run and for a fork's two parts."""
    streamed = tmp_path / "streamed.jsonl"
    with StubServer(RETRIED) as server:
        with recorder.record(streamed):
            agent(server.url, stream=True)
        forked = tmp_path / "fork.jsonl"
        tool = next(line["seq"] for line in read_lines(retried) if line.get("kind") == "tool")
        with replayer.fork(retried, at=tool, out=forked, sets=['result=["auth/token.py"]']):
            agent(server.url)
    _collect_clients()
    for path in (streamed, forked, retried):
        whole = list(load(path).observations)
        totals = run_totals(load(path))  # loaded again: no line restored before
        start = totals["live_from"]
        assert totals["all"] == totals_of(whole), path.stem
        assert totals["replayed"] == (totals_of(o for o in whole if o["seq"] < start)
                                      if start else None)
        assert totals["live"] == (totals_of(o for o in whole if o["seq"] >= start)
                                  if start else None)
    assert totals_of(load(streamed).observations)["input_tokens"] == 320
    assert live_from(load(forked)) > 0


def test_a_summary_given_the_step_rows_restores_no_line_whole_again(
        retried: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`deja show` and the viewer's index make every step's row, each line restored whole;
    the run's summary then takes its models from those rows. It is the summary made
    without them, and it restores no line whole a second time."""
    streamed = tmp_path / "streamed.jsonl"
    with StubServer(RETRIED) as server:
        with recorder.record(streamed):
            agent(server.url, stream=True)
    _collect_clients()
    whole: list[int] = []
    restore = Store.line
    monkeypatch.setattr(Store, "line", lambda self, seq: whole.append(seq) or restore(self, seq))
    for path in (streamed, retried):
        cassette = load(path)
        whole.clear()
        rows = step_rows(cassette)
        assert whole == list(range(len(cassette.observations)))
        summary = run_summary(cassette, rows=rows)
        assert whole == list(range(len(cassette.observations))), path.stem  # none again
        assert summary == run_summary(load(path)), path.stem
        assert summary["models"] == [MODEL]


def test_an_error_is_an_exception_or_an_error_the_response_reports(retried: Path) -> None:
    refused = next(o for o in load(retried).observations if o.get("api_error"))
    assert error_of(refused) == refused["api_error"]
    assert step_error(refused) == f"{refused['api_error']['type']}: " \
                                  f"{refused['api_error']['message']}"
    assert error_of({"kind": "tool", "error": {"type": "KeyError", "message": "x"}})
    assert error_of({"kind": "http", "response": {"status": 500}}) is None
    t = zero_totals()
    add_step(t, {"kind": "outcome", "error": {"type": "OSError"}})
    add_step(t, {"kind": "intent", "name": "pay"})
    add_step(t, {"kind": "control", "event": "resumed"})
    assert t == {**zero_totals(), "tool_calls": 1, "errors": 1}


# -- one rule for where a run's file goes


def test_a_run_file_is_a_jsonl_file_or_goes_in_a_directory(tmp_path: Path) -> None:
    assert run_file(tmp_path / "run.jsonl", "r_1") == tmp_path / "run.jsonl"
    assert run_file(tmp_path, "r_1") == tmp_path / "r_1.jsonl"
    folder = tmp_path / "taken.jsonl"  # a directory, whatever its name says
    folder.mkdir()
    assert run_file(folder, "r_1") == folder / "r_1.jsonl"
    assert run_file(tmp_path / "new", "r_1") == tmp_path / "new" / "r_1.jsonl"
    assert run_file(f"{tmp_path / 'new.d'}{os.sep}", "r_1") == tmp_path / "new.d" / "r_1.jsonl"
    assert run_file(tmp_path / "run.json", "r_1") == tmp_path / "run.json"  # as record() had it
    plain = tmp_path / "notes"
    plain.write_text("")
    with pytest.raises(errors.ConfigError, match=r"name a file ending in \.jsonl"):
        run_file(plain, "r_1")


def test_a_directory_made_by_a_run_starting_beside_is_taken_as_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two runs told the same new directory start at once: the second looks after the
    first has made it. (Made here between the two looks run_file takes.)"""
    target = tmp_path / "runs"
    looked = Path.is_dir

    def made_after_the_first_look(self: Path) -> bool:
        seen = looked(self)
        if self == target and not seen:
            os.mkdir(target)
        return seen

    monkeypatch.setattr(Path, "is_dir", made_after_the_first_look)
    assert run_file(target, "r_2") == target / "r_2.jsonl"


def test_record_and_fork_put_their_file_by_that_rule(retried: Path, tmp_path: Path) -> None:
    folder = tmp_path / "runs"
    with recorder.record(folder) as run:
        recorder.uuid4()
    assert run.path == folder / f"{run.run_id}.jsonl"
    with recorder.record(tmp_path / "run.json") as named:  # a suffix names the file
        recorder.uuid4()
    assert named.path == tmp_path / "run.json" and named.path.is_file()
    plain = tmp_path / "notes"
    plain.write_text("")
    with pytest.raises(errors.ConfigError, match="a file without a suffix"):
        recorder.record(plain).__enter__()
    model = next(line["seq"] for line in read_lines(retried)
                 if line.get("kind") == "model" and line["response"]["status"] == 200)
    edit = ["content.0.text=x"]
    assert replayer.plan_fork(retried, model, sets=edit,
                              out=tmp_path / "f.json").out == tmp_path / "f.json"
    with pytest.raises(errors.ConfigError, match="a file without a suffix"):
        replayer.plan_fork(retried, model, sets=edit, out=plain)
    plan = replayer.plan_fork(retried, model, sets=edit, out=folder)
    assert plan.out == folder / f"{plan.run_id}.jsonl"


# -- timestamps and headers


def test_timestamps_are_utc_with_a_z(retried: Path) -> None:
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", utc_stamp())
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", utc_stamp("seconds"))
    assert re.fullmatch(r".*T.*\.\d{3}Z", read_lines(retried)[0]["created"])


def test_peek_header_reads_the_first_line_only(retried: Path, tmp_path: Path) -> None:
    header = peek_header(retried)
    assert header is not None and header["run"] == load(retried).run
    (tmp_path / "list.jsonl").write_text("[1, 2]\n")
    assert peek_header(tmp_path / "list.jsonl") is None
    assert peek_header(tmp_path / "missing.jsonl") is None


def test_peek_end_reads_the_last_line_from_the_tail(retried: Path, tmp_path: Path) -> None:
    whole = retried.read_bytes()
    end = json.loads(whole.splitlines()[-1])  # as on disk, its signature too
    assert end["kind"] == "end" and load(retried).end == {k: v for k, v in end.items()
                                                           if k != "sig"}
    assert peek_end(retried) == end and cassette_end(retried) == ("ended", end)
    header_only = tmp_path / "open.jsonl"
    header_only.write_bytes(whole.split(b"\n", 1)[0] + b"\n")
    assert peek_end(header_only) is None and cassette_end(header_only) == ("open", None)
    crlf = tmp_path / "crlf.jsonl"
    crlf.write_bytes(whole.replace(b"\n", b"\r\n"))
    assert peek_end(crlf) == end
    assert peek_end(tmp_path / "missing.jsonl") is None and peek_end(tmp_path) is None
    (tmp_path / "empty.jsonl").touch()
    assert peek_end(tmp_path / "empty.jsonl") is None
    assert cassette_end(tmp_path / "empty.jsonl") == ("none", None)


@pytest.mark.parametrize("cut", [1, 20, "the newline"])
def test_a_torn_end_line_is_no_end(retried: Path, tmp_path: Path, cut: int | str) -> None:
    """An end line cut short, even one that lacks only its newline, is torn: the reader
    refuses it and a resume cuts it, so the run is open, not ended."""
    whole = retried.read_bytes()
    torn = tmp_path / "torn.jsonl"
    torn.write_bytes(whole[:-1] if cut == "the newline" else whole[:-1 - int(cut)])
    assert peek_end(torn) is None and cassette_end(torn) == ("open", None)


def test_a_huge_last_line_is_read_whole_and_only_it(retried: Path, tmp_path: Path) -> None:
    lines = retried.read_bytes().splitlines(keepends=True)
    end = json.loads(lines[-1])
    long_end = dict(end, error={"type": "ValueError", "module": "builtins",
                                "message": "x" * (5 * PEEK_CHUNK + 17)})
    huge = tmp_path / "huge.jsonl"
    huge.write_bytes(b"".join(lines[:-1]) + json.dumps(long_end).encode() + b"\n")
    assert peek_end(huge) == long_end  # spans several chunks: read back to its start
    big_step = tmp_path / "big-step.jsonl"  # an open run whose last step is large
    big_step.write_bytes(b"".join(lines[:-2]) + json.dumps(
        {"seq": 99, "kind": "tool", "result": "y" * (3 * PEEK_CHUNK)}).encode() + b"\n")
    assert peek_end(big_step) is None
    sparse = tmp_path / "sparse.jsonl"  # a gigabyte before the end: never read
    with sparse.open("wb") as f:
        f.write(lines[0])
        f.seek(1 << 30)
        f.write(b"\n" + lines[-1])
    assert peek_end(sparse) == end and cassette_end(sparse) == ("ended", end)
