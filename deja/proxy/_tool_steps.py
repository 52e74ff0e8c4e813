"""The agent's tool steps as the proxy sees them: in the conversation its requests carry.

An agent behind the proxy runs its tools itself; the proxy sees a tool step only as a
call in one response and its result in a later request. So:

- a request's tool results the run has not seen yet are logged as tool steps, with the
  time since the last response as their duration, and the guards see them
  (:func:`boundary`);
- in a served run (a replay, a fork's prefix), a tool result other than the recorded one
  is a divergence at that tool's step (:func:`check_results`);
- a fork at a tool step puts the edited result in place of what the agent sends, in that
  request and every later one (:func:`substitute`);
- a reply names the tool calls it asks for, which a Responses request continuing it by
  ``previous_response_id`` (:func:`is_responses`) answers without repeating them, whether
  it leaves the turn to the agent, and its id, by which such a request finds its run
  (:func:`read_reply`).

Calls and results are read through the request's conversation, whatever its provider
(:mod:`recorder.providers.conversation`); a result's content is what the agent sent,
where its provider's format finds it in the body (``Provider.tool_result_slots``), so that
it is logged, compared and edited as sent.
"""

from __future__ import annotations

import json
import time
from typing import Any

from deja.proxy.runs import ProxyRun, Registry, calls_by_id, conversation_items
from recorder import providers
from recorder.cassette.schema import Kind
from recorder.errors import Divergence, DivergenceInfo
from recorder.providers import Provider, conversation
from recorder.providers.conversation import PlacedResult

__all__ = ["boundary", "check_results", "is_responses", "read_reply", "substitute"]


def _first_new(run: ProxyRun, body: dict[str, Any], items: list[Any],
               keys: list[str] | None) -> int:
    """Where the items a request adds to the run's last one start."""
    if isinstance(body.get("previous_response_id"), str):
        return 0  # a Responses request that continues one: every item is new
    n = len(run.last_keys)
    if keys is not None and keys[:n] == run.last_keys:
        return n
    return max(0, len(items) - 1)


def _new_results(run: ProxyRun, body: dict[str, Any], keys: list[str] | None,
                 seam: Provider | None) -> tuple[Provider, list[PlacedResult]] | None:
    """The provider that reads ``body`` and the tool results it adds that the run has not
    logged yet (None: it adds none). The added items are read first, alone (cheap); the
    whole request only when they hold a result (its ids are numbered in the whole)."""
    items = conversation_items(body, seam)
    history = seam.history_field(body) if seam is not None else providers.history_field(body)
    if items is None or history is None:
        return None
    start = _first_new(run, body, items, keys)
    added = {history: items[start:]}
    provider = seam or conversation.reader_of(added)
    if provider is None or not conversation.placed_results(provider, added):
        return None
    offset = sum(isinstance(item, dict) for item in items[:start])  # turns before them
    fresh = [p for p in conversation.placed_results(provider, body) if p.turn >= offset
             and p.result.tool_use_id is not None and p.result.tool_use_id not in run.logged]
    return (provider, fresh) if fresh else None


def boundary(run: ProxyRun, rec: Any, body: dict[str, Any], keys: list[str] | None,
             seam: Provider | None = None) -> None:
    """Log the tool results this request brings that the run has not seen yet (and
    let the guards see them). ``seam``: the request's provider (found from the body when
    not given, :func:`recorder.providers.conversation.reader_of`)."""
    found = _new_results(run, body, keys, seam)
    if found is None:
        return
    provider, results = found
    turns = conversation.turns(provider.conversation(body))
    calls = {**run.calls, **calls_by_id(conversation.numbered_calls(turns))}
    now = time.time()
    since = run.answered  # the tools ran between the last response and this request
    for placed in results:
        call = str(placed.result.tool_use_id)
        name, args = calls.get(call, (placed.result.name or "unknown", None))
        run.logged.add(call)
        rec.observe_tool(name, args if isinstance(args, dict) else {"input": args},
                         placed.sent, call_id=call, is_error=placed.result.is_error,
                         start=since or now,
                         ms=(now - since) * 1000 if since is not None else None)


def _placed(body: dict[str, Any], seam: Provider | None) -> list[PlacedResult]:
    """Every tool result ``body`` carries, read by its provider (``seam``, or the one
    whose format reads the body)."""
    provider = seam or conversation.reader_of(body)
    return conversation.placed_results(provider, body) if provider is not None else []


def check_results(run: ProxyRun, body: dict[str, Any], seam: Provider | None = None) -> None:
    """A served run (a replay, a fork's prefix): a tool result that is not what the
    recording observed for its call is a divergence at that tool's step, the step
    ``deja diff`` would name, rather than at the model request that carries it."""
    from replayer.diff import unified

    for placed in _placed(body, seam):
        call = placed.result.tool_use_id
        obs = run.recorded.get(call) if call is not None else None
        if obs is None or obs.get("edited"):
            continue
        got, is_error = placed.sent, placed.result.is_error
        if got == obs.get("result") and is_error == bool(obs.get("is_error")):
            continue
        expected = {"name": obs["name"], "args": obs.get("args"), "result": obs.get("result")}
        actual = {**expected, "result": got}
        if is_error:
            actual["is_error"] = True
        if obs.get("is_error"):
            expected["is_error"] = True
        info = DivergenceInfo(
            step=obs["seq"], kind=Kind.TOOL.value,
            reason=f"the agent's tool {obs['name']!r} returned something other than "
                   f"the recorded result (call {call})",
            expected=expected, actual=actual, diff=unified(expected, actual))
        served: Any = getattr(run.session, "prefix", run.session)  # a fork: its prefix
        if getattr(served, "divergence", None) is None:
            served.divergence = info
        raise Divergence(info, path=getattr(served, "path", None))


def substitute(body: dict[str, Any], edits: dict[str, Any], raw: bytes,
               seam: Provider | None = None) -> bytes:
    """The request with each edited tool result in place of what the agent sent (a fork
    at a tool step: the model sees the edit in every later request too); ``body`` is
    edited in place."""
    changed = False
    for placed in _placed(body, seam) if edits else ():
        call = placed.result.tool_use_id
        if call in edits and placed.slot is not None and placed.sent != edits[call]:
            placed.slot.put(edits[call])
            changed = True
    if not changed:
        return raw
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def is_responses(path: str) -> bool:
    """Is this a call of the OpenAI Responses API (``POST /v1/responses``)?"""
    return path.rstrip("/").endswith("/responses")


def read_reply(registry: Registry, run: ProxyRun, seam: providers.Provider,
               headers: list[tuple[str, str]], body: bytes) -> None:
    """What a reply means for the run's boundaries: the tool calls it asks for (a
    Responses request continuing it by ``previous_response_id`` sends their results
    without them), whether it leaves the turn to the agent (how an idle run ends), and
    its id, by which such a request finds the run."""
    try:
        message = seam.message(headers, body)
    except ValueError:
        return
    if not isinstance(message, dict):
        return
    answer = conversation.reply(seam.conversation(None, message))
    run.calls.update(calls_by_id(conversation.numbered_calls([answer] if answer else [])))
    run.awaiting_tools = conversation.reply_unfinished(seam, message)
    if isinstance(message.get("id"), str):
        registry.replied(run, message["id"])
