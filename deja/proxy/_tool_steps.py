"""The agent's tool steps as the proxy sees them: in the conversation its requests carry.

An agent behind the proxy runs its tools itself; the proxy sees a tool step only as a
call in one response and its result in a later request. So a request's tool results are
read once, through its provider (the proxy knows it from the URL), with the id each has in
the run (:func:`read_results`), and then:

- the results the run has not seen yet are logged as tool steps, with the time since the
  last response as their duration, and the guards see them (:func:`boundary`);
- in a served run (a replay, a fork's prefix), a tool result other than the recorded one
  is a divergence at that tool's step (:func:`check_results`); a replay-then-live leaves
  its recording there instead (:func:`changed_result`, :mod:`deja.proxy._then_live`);
- a fork at a tool step puts the edited result in place of what the agent sends, in that
  request and every later one (:func:`substitute`), as a replay-then-live puts the tool
  policy's answer;
- once the request is taken, its conversation ends with it (:func:`follow`);
- a reply names the tool calls it asks for, which a Responses request continuing it by
  ``previous_response_id`` (:func:`is_responses`) answers without repeating them, whether
  it leaves the turn to the agent, and its id, by which such a request finds its run
  (:func:`read_reply`).

A result's id is the run's (:class:`deja.proxy.runs.Dialogues`): unique in the run, so that
two conversations of a named run that both answer Gemini's id-less ``lookup`` log two
steps. A request that continues its conversation is read only in the items it adds,
numbered on from where its conversation left off; the whole request is read when every
result counts (a served run checks them all, a fork edits them all) or when its
conversation is new to the run. Calls and results are read through the request's
conversation (:mod:`recorder.providers.conversation`); a result's content is what the
agent sent, where its provider's format finds it in the body
(``Provider.tool_result_slots``), so that it is logged, compared and edited as sent.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from deja.proxy.runs import (
    Dialogue,
    ProxyRun,
    Registry,
    calls_by_id,
    conversation_items,
    substituted,
)
from recorder import providers
from recorder.cassette.schema import Kind
from recorder.errors import Divergence, DivergenceInfo
from recorder.providers import Provider, conversation
from recorder.providers.base import Conversation
from recorder.providers.conversation import PlacedResult

__all__ = ["Reading", "Result", "boundary", "call_of", "changed_result", "check_results",
           "follow", "is_responses", "read_reply", "read_results", "substitute"]


@dataclass(frozen=True)
class Result:
    """A tool result a request carries: its id in the run and in its conversation
    (numbered, :func:`recorder.providers.conversation.numbered_results`), where it is in
    the body, and whether it is new (in the items the request adds)."""

    run_id: str
    local: str
    placed: PlacedResult
    fresh: bool


@dataclass
class Reading:
    """A model request's tool results as its run knows them (:func:`read_results`)."""

    provider: Provider
    body: dict[str, Any]
    keys: list[str]
    dialogue: Dialogue | None  # the conversation it continues (None: it starts one)
    chained: bool  # it continues a Responses reply by previous_response_id
    results: list[Result] = field(default_factory=list)
    calls: dict[str, tuple[str, Any]] = field(default_factory=dict)  # of the items read
    whole: bool = False  # every item was read (else those it adds)
    # its conversation's counts of call and result ids (Dialogue.calls, .results), after it
    counts: tuple[dict[str, int], dict[str, int]] = field(default_factory=lambda: ({}, {}))
    given: dict[str, str] = field(default_factory=dict)  # new run ids -> their raw ids


def _number(seen: dict[str, int], raw: str | None) -> str | None:
    """``raw``, or ``raw#n`` for its n-th use among those ``seen`` (counted on)."""
    if raw is None:
        return None
    count = seen[raw] = seen.get(raw, 0) + 1
    return raw if count == 1 else f"{raw}#{count}"


def _numbered(reading: Reading, conv: Conversation, seed: Dialogue | None
              ) -> list[tuple[str | None, str | None]]:
    """Read ``conv``'s calls into ``reading`` and return its results' (id, numbered id),
    in order: numbered as :mod:`recorder.providers.conversation` numbers a whole
    request, on from ``seed``'s counts (the items before these, in its conversation)."""
    calls_seen = dict(seed.calls) if seed is not None else {}
    results_seen = dict(seed.results) if seed is not None else {}
    numbered: list[tuple[str | None, str | None]] = []
    for turn in conversation.turns(conv):
        if conversation.role(turn) == "assistant":
            for call in conversation.tool_calls(turn):
                local = _number(calls_seen, call.id)
                if local is not None:
                    reading.calls[local] = (str(call.name), call.input)
        else:
            numbered += [(result.tool_use_id, _number(results_seen, result.tool_use_id))
                         for result in conversation.tool_results(turn)]
    reading.counts = (calls_seen, results_seen)
    return numbered


def read_results(run: ProxyRun, body: dict[str, Any], keys: list[str] | None,
                 seam: Provider, *, whole: bool = False,
                 retry: bool | None = None) -> Reading | None:
    """The tool results of model request ``body`` (message ``keys``) of provider ``seam``,
    each with its id in ``run``: those it adds to its conversation (new ones get the run's
    next id), and with ``whole`` every one it carries. ``retry``: whether the client says
    the request is a retry (:meth:`deja.proxy.runs.Dialogues.find`). None: it holds no
    conversation."""
    items = conversation_items(body, seam)
    history = seam.history_field(body)
    if items is None or history is None or not keys:
        return None
    chained = isinstance(body.get("previous_response_id"), str)  # every item is new
    dialogue = None if chained else run.dialogues.find(keys, retry)
    start = 0 if chained else len(dialogue.keys) if dialogue is not None \
        else max(0, len(items) - 1)  # met mid-way (a named run's): its last item is new
    reading = Reading(seam, body, keys, dialogue, chained,
                      whole=whole or (dialogue is None and start > 0))
    read = body if reading.whole else {history: items[start:]}
    conv = seam.conversation(read)
    numbered = _numbered(reading, conv, None if reading.whole else dialogue)
    offset = sum(isinstance(item, dict) for item in items[:start]) if reading.whole else 0
    for placed, (raw, local) in zip(conversation.placed_results(seam, read, conv), numbered,
                                    strict=True):
        if raw is None or local is None:
            continue
        fresh = placed.turn >= offset
        run_id = _fresh_id(run, reading, raw, local) if fresh else \
            dialogue.ids.get(local, local) if dialogue is not None else local
        reading.results.append(Result(run_id, local, placed, fresh))
    return reading


def _fresh_id(run: ProxyRun, reading: Reading, raw: str, local: str) -> str:
    """The run's id for a new result (``raw``, numbered ``local`` in its conversation): a
    Responses call's own (unique, and a retry of the request gets it again), else
    ``local`` unless another conversation of the run has it
    (:meth:`deja.proxy.runs.Dialogues.fresh`)."""
    known = reading.dialogue.ids.get(local) if reading.dialogue is not None else None
    run_id = local if reading.chained else known or run.dialogues.fresh(raw, local, reading.given)
    reading.given[run_id] = raw
    return run_id


def follow(run: ProxyRun, reading: Reading | None) -> Dialogue | None:
    """The request ``reading`` read was taken: the ids it gave are the run's, and its
    conversation (returned: its caller says when it is answered, ``Dialogue.settled``)
    now ends with it."""
    if reading is None:
        return None
    run.dialogues.take(reading.given)
    if reading.chained:
        return None
    dialogue = run.dialogues.advance(reading.dialogue, reading.keys)
    dialogue.calls, dialogue.results = reading.counts
    dialogue.ids.update((r.local, r.run_id) for r in reading.results if r.fresh)
    return dialogue


def call_of(run: ProxyRun, reading: Reading, result: Result) -> tuple[str, Any]:
    """(name, input) of the call ``result`` answers: in the items read, in a Responses
    reply the request continues, else in the whole request (its name alone, when the
    agent answered a call the conversation does not hold)."""
    found = reading.calls.get(result.local) or run.calls.get(result.local)
    if found is None and not reading.whole:
        whole = Reading(reading.provider, reading.body, reading.keys, None, reading.chained)
        _numbered(whole, reading.provider.conversation(reading.body), None)
        found = whole.calls.get(result.local)
    return found or (result.placed.result.name or "unknown", None)


def boundary(run: ProxyRun, rec: Any, reading: Reading) -> None:
    """Log the tool results of the request ``reading`` read that the run has not seen yet
    (and let the guards see them): by the run's session, or, in a replay-then-live, by
    what follows its recording (which marks a result the model was given in the agent's
    place). A result of a call the agent made through the proxy's MCP endpoint is that
    call's step already, and is not logged twice."""
    now = time.time()
    since = run.answered  # the tools ran between the last response and this request
    observe = run.policy.observe if run.policy is not None else rec.observe_tool
    for result in reading.results:
        if not result.fresh or result.run_id in run.logged:
            continue
        name, args = call_of(run, reading, result)
        run.logged.add(result.run_id)
        if run.took_over_by_mcp(name, args):  # made through --mcp: its line is written
            continue
        observe(name, args if isinstance(args, dict) else {"input": args},
                result.placed.sent, call_id=result.run_id,
                is_error=result.placed.result.is_error, start=since or now,
                ms=(now - since) * 1000 if since is not None else None)


def changed_result(run: ProxyRun, reading: Reading) -> tuple[int, DivergenceInfo] | None:
    """The first tool result of the request ``reading`` read that is not what the
    recording observed for its call (a served run: a replay, a fork's prefix, a
    replay-then-live while it follows its recording), with its place among the reading's
    results and the divergence at that tool's step; None: every one is as recorded.
    Results the model was given in the agent's place (a fork's edit, a tool policy's
    answer) are put in place afterwards, and not compared."""
    from replayer.diff import unified

    for place, result in enumerate(reading.results):
        call = result.run_id
        obs = run.recorded.get(call)
        if obs is None or substituted(obs):
            continue
        got, is_error = result.placed.sent, result.placed.result.is_error
        if got == obs.get("result") and is_error == bool(obs.get("is_error")):
            continue
        expected = {"name": obs["name"], "args": obs.get("args"), "result": obs.get("result")}
        actual = {**expected, "result": got}
        if is_error:
            actual["is_error"] = True
        if obs.get("is_error"):
            expected["is_error"] = True
        return place, DivergenceInfo(
            step=obs["seq"], kind=Kind.TOOL.value,
            reason=f"the agent's tool {obs['name']!r} returned something other than "
                   f"the recorded result (call {call})",
            expected=expected, actual=actual, diff=unified(expected, actual))
    return None


def check_results(run: ProxyRun, reading: Reading) -> None:
    """A served run (a replay, a fork's prefix): a tool result that is not what the
    recording observed for its call is a divergence at that tool's step, the step
    ``deja diff`` would name, rather than at the model request that carries it."""
    changed = changed_result(run, reading)
    if changed is None:
        return
    info = changed[1]
    served: Any = getattr(run.session, "prefix", run.session)  # a fork: its prefix
    if getattr(served, "divergence", None) is None:
        served.divergence = info
    raise Divergence(info, path=getattr(served, "path", None))


def substitute(reading: Reading, edits: dict[str, Any], raw: bytes,
               errors: Mapping[str, bool] | None = None) -> bytes:
    """The request with each edited tool result in place of what the agent sent (a fork
    at a tool step: the model sees the edit in every later request too), an error or not
    as ``errors`` says (where the format marks one: a ``tool_result`` block's flag); the
    body ``reading`` read (whole) is edited in place."""
    changed = False
    for result in reading.results:
        slot = result.placed.slot
        if result.run_id not in edits or slot is None:
            continue
        if result.placed.sent != edits[result.run_id]:
            slot.put(edits[result.run_id])
            changed = True
        failed = (errors or {}).get(result.run_id)
        if failed is not None and failed != result.placed.result.is_error \
                and conversation.kind(slot.holder) is conversation.BlockKind.TOOL_RESULT:
            _flag(slot.holder, failed)
            changed = True
    if not changed:
        return raw
    return json.dumps(reading.body, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def _flag(block: dict[str, Any], failed: bool) -> None:
    """A ``tool_result`` block (in deja's conversation shape, which the Messages API
    shares) marked as an error, or not."""
    if failed:
        block["is_error"] = True
    else:
        block.pop("is_error", None)


def is_responses(path: str) -> bool:
    """Is this a call of the OpenAI Responses API (``POST /v1/responses``)?"""
    return path.rstrip("/").endswith("/responses")


def read_reply(registry: Registry, run: ProxyRun, seam: providers.Provider,
               headers: list[tuple[str, str]], body: bytes, *, chained: bool) -> None:
    """What a successful reply means for the run's boundaries, read by its provider:
    whether it leaves the turn to the agent (it asks for tools, or its stop reason says
    so: how an idle run ends, :meth:`ProxyRun.end_status`). A reply that can be
    ``chained`` (a Responses reply: a request continuing it by ``previous_response_id``
    sends the results of the calls it asks for without the calls) also gives those
    calls, and its id, by which such a request finds the run."""
    try:
        message = seam.message(headers, body)
    except ValueError:
        return
    if not isinstance(message, dict):
        return
    run.awaiting_tools = conversation.reply_unfinished(seam, message)
    if not chained:
        return
    answer = conversation.reply(seam.conversation(None, message))
    run.calls.update(calls_by_id(conversation.numbered_calls([answer] if answer else [])))
    if isinstance(message.get("id"), str):
        registry.replied(run, message["id"])
