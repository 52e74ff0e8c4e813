"""A loaded cassette keeps the file's bytes and each line's head, not the lines restored.

``load`` checks every signature and keeps what a replay matches on; a model line's
fingerprint, which needs its request rebuilt, is worked out in file order when first asked
for, and a line is restored from its bytes when it is read. These tests record a real
SDK against the stub server and look at what a loaded cassette and a replay index hold
(object structure, never timing), and that lines read in any order, or again, are the
lines the file holds.
"""

from __future__ import annotations

import gc
import json
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import recorder
from recorder import canonical, providers
from recorder.cassette import _delta, load
from recorder.cassette.lines import Lines
from recorder.cassette.reader import verified_prefix
from recorder.cassette.rows import run_totals
from recorder.cassette.schema import Kind
from replayer.index import Index
from tests.recorder.test_cassette_size import messages_agent, script

TURNS = 40  # model calls: more than any cache of restored lines, requests or headers holds


@pytest.fixture
def recorded(stub: Callable[[dict[str, Any]], Any], tmp_path: Path) -> Path:
    path = tmp_path / "run.jsonl"
    with recorder.record(path):
        messages_agent(stub(script(TURNS)).url)
    return path


def reachable_dicts(root: object, key: str) -> list[dict[str, Any]]:
    """The dicts holding ``key`` that ``root`` reaches, through any references."""
    seen: set[int] = set()
    found: list[dict[str, Any]] = []
    todo = [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, str | bytes | int | float | type):
            continue
        seen.add(id(obj))
        if isinstance(obj, dict) and key in obj:
            found.append(obj)
        todo.extend(gc.get_referents(obj))
    return found


def test_a_loaded_cassette_holds_no_restored_line(recorded: Path) -> None:
    cassette = load(recorded, require_signature=True)
    assert isinstance(cassette.observations, Lines)
    assert len(cassette.observations) == TURNS
    # no response, no request rebuilt: each line is the bytes read, and its head
    assert reachable_dicts(cassette, "response") == []
    assert reachable_dicts(cassette, "messages") == []
    assert all(h.kind == Kind.MODEL and h.fp for h in cassette.observations.heads)


def test_reading_every_line_keeps_only_the_last_few(recorded: Path) -> None:
    cassette = load(recorded, require_signature=True)
    for line in cassette.observations:
        assert line["response"]["headers"] and line["fp"]
    held = reachable_dicts(cassette, "response")
    assert 0 < len(held) < TURNS // 2


def test_the_replay_index_keeps_keys_and_seqs_not_lines(recorded: Path) -> None:
    cassette = load(recorded, require_signature=True)
    index = Index(cassette)
    assert reachable_dicts(index.__dict__, "response") == []
    line = index.take(("net", cassette.observations.heads[3].fp or ""))
    assert line is not None and line["seq"] == 3


def test_lines_read_in_any_order_are_the_lines_in_order(recorded: Path) -> None:
    """Backwards (each line's references followed from scratch), and again in order, a
    line, its request and its signature are the same as when read first to last."""
    forwards = load(recorded, require_signature=True)
    in_order = [(dict(line), forwards.requests[line["seq"]]) for line in forwards.observations]
    backwards = load(recorded, require_signature=True)
    seqs = range(len(in_order) - 1, -1, -1)
    assert [(dict(backwards.observations[s]), backwards.requests[s]) for s in seqs] == \
        in_order[::-1]
    assert list(forwards.observations) == [line for line, _ in in_order]
    written = [json.loads(raw)["sig"] for raw in recorded.read_bytes().splitlines()]
    assert list(backwards.sigs) == written
    assert backwards.replies.get(0) is not None  # the answer seq 1 resends


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_reading_the_lines_in_order_parses_each_line_once(
        stub: Callable[[dict[str, Any]], Any], tmp_path: Path, stream: bool) -> None:
    """A replay reads a line, the request it extends, the answer it resends and the
    response headers it edits: each is kept from the line read before, none parsed again."""
    path = tmp_path / "run.jsonl"
    with recorder.record(path):
        messages_agent(stub(script(TURNS)).url, stream=stream)
    cassette = load(path, require_signature=True)
    store = cassette.observations._store
    parsed: list[int] = []
    parse = store._parse

    def counting(seq: int, check: bool = True) -> tuple[dict[str, Any], bool]:
        parsed.append(seq)
        return parse(seq, check)

    store._parse = counting  # type: ignore[method-assign]
    restored = [dict(line) for line in cassette.observations]
    assert parsed == list(range(TURNS))
    again = load(path, require_signature=True)
    assert restored == [dict(again.observations[seq]) for seq in reversed(range(TURNS))][::-1]
    assert all(line["request"].get("base") == line["seq"] - 1 for line in restored[1:])


def test_the_kept_lines_stay_bounded_when_threads_restore_at_once() -> None:
    """Calls replayed from several threads restore lines at once: dropping the oldest
    kept value never fails (the same one dropped twice, the dict grown meanwhile), and
    what is kept stays within its bound."""
    import sys
    import threading

    from recorder.cassette.lines import _Recent

    kept = _Recent(size=2)
    errors: list[BaseException] = []

    def keep(k: int) -> None:
        try:
            for i in range(20_000):
                kept.keep(k * 1_000_000 + i, i)
        except (KeyError, RuntimeError) as exc:  # a replayed call: a corrupt cassette
            errors.append(exc)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    try:
        threads = [threading.Thread(target=keep, args=(k,)) for k in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []
    assert len(kept) <= 2


def test_load_rebuilds_no_request_and_the_fingerprints_are_each_requests_own(
        recorded: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader that matches no call (a run's totals, its kinds) never rebuilds a request;
    the first that needs a fingerprint has every request up to it rebuilt, once each, in
    file order, and each fingerprint is the one its request gets on its own."""
    rebuilt: list[int | None] = []
    decode = _delta.decode

    def counting(stored: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        rebuilt.append(kwargs.get("seq", args[4] if len(args) > 4 else None))
        return decode(stored, *args, **kwargs)

    monkeypatch.setattr(_delta, "decode", counting)
    cassette = load(recorded, require_signature=True)
    steps = cassette.observations
    assert isinstance(steps, Lines)
    assert run_totals(cassette)["all"]["steps"] == TURNS
    assert [kind for _, kind, _ in steps.kinds()] == [Kind.MODEL] * TURNS
    assert rebuilt == []

    last = steps[TURNS - 1]  # read far first: the lines before it are passed in order
    assert rebuilt == list(range(TURNS))
    heads = steps.heads
    assert rebuilt == list(range(TURNS))  # passed once: asking again rebuilds nothing
    assert last["fp"] == heads[TURNS - 1].fp
    for head in heads:
        line = steps[head.seq]
        alone = providers.for_line(line).fingerprint("POST", line["url"],
                                                     cassette.requests[head.seq])
        assert head.fp == line["fp"] == alone
    assert len({h.fp for h in heads}) == TURNS


def test_each_request_is_rebuilt_once_by_repair_and_a_cassette_read_in_part_is_freed(
        recorded: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``deja repair``'s reading (:func:`verified_prefix`) passes each line as it checks it:
    every request is rebuilt once, not again from the first line for each line added. A
    cassette one request of which was read is freed as soon as it is let go (its store
    keeps the pass, which must not keep the store alive)."""
    rebuilt: list[Any] = []
    decode = _delta.decode

    def counting(stored: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        rebuilt.append(stored)
        return decode(stored, *args, **kwargs)

    hashed: list[Any] = []
    digest = canonical.digest

    def hashing(value: Any) -> str:
        hashed.append(value)
        return digest(value)

    monkeypatch.setattr(_delta, "decode", counting)
    monkeypatch.setattr(canonical, "digest", hashing)
    load(recorded, require_signature=True).observations.heads  # noqa: B018
    once = len(hashed)  # one pass: each item of a history hashed once
    assert len(rebuilt) == TURNS
    rebuilt.clear()
    hashed.clear()
    prefix = verified_prefix(recorded)
    assert prefix.fault is None and prefix.lines == TURNS + 2
    assert len(rebuilt) == TURNS and len(hashed) == once  # not again from line 0, each line

    cassette = load(recorded, require_signature=True)
    assert cassette.requests[TURNS // 2]["messages"]
    gone = weakref.ref(cassette.observations._store)  # type: ignore[attr-defined]
    was = gc.isenabled()
    gc.disable()  # reference counting alone
    try:
        del cassette
        assert gone() is None
    finally:
        if was:
            gc.enable()
