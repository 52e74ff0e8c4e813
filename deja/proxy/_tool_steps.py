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
- a Responses API reply (:func:`is_responses`) names the function calls it asks for, which
  a request continuing it by ``previous_response_id`` answers without repeating them, and
  its id, by which such a request finds its run (:func:`read_reply`).
"""

from __future__ import annotations

import json
import time
from typing import Any

from deja.proxy.runs import ProxyRun, Registry, conversation_items, tool_calls, tool_results
from recorder import providers
from recorder.cassette.schema import Kind
from recorder.errors import Divergence, DivergenceInfo

__all__ = ["boundary", "check_results", "is_responses", "read_reply", "substitute"]


def boundary(run: ProxyRun, rec: Any, body: dict[str, Any], keys: list[str] | None) -> None:
    """Log the tool results this request brings that the run has not seen yet (and
    let the guards see them)."""
    messages = conversation_items(body)
    if messages is None:
        return
    n = len(run.last_keys)
    if isinstance(body.get("previous_response_id"), str):
        new = messages  # a Responses request that continues one: every item is new
    elif keys is not None and keys[:n] == run.last_keys:
        new = messages[n:]
    else:
        new = messages[-1:]
    results = [r for r in tool_results(new) if r["tool_use_id"] not in run.logged]
    if not results:
        return
    calls = {**run.calls, **tool_calls(messages)}
    now = time.time()
    since = run.answered  # the tools ran between the last response and this request
    for block in results:
        call = block["tool_use_id"]
        name, args = calls.get(call, ("unknown", None))
        run.logged.add(call)
        rec.observe_tool(name, args if isinstance(args, dict) else {"input": args},
                         block.get("content", ""), call_id=call,
                         is_error=block.get("is_error") is True, start=since or now,
                         ms=(now - since) * 1000 if since is not None else None)


def check_results(run: ProxyRun, body: dict[str, Any]) -> None:
    """A served run (a replay, a fork's prefix): a tool result that is not what the
    recording observed for its call is a divergence at that tool's step, the step
    ``deja diff`` would name, rather than at the model request that carries it."""
    from replayer.diff import unified

    for block in tool_results(conversation_items(body) or []):
        obs = run.recorded.get(block["tool_use_id"])
        if obs is None or obs.get("edited"):
            continue
        got = block.get("content", "")
        if got == obs.get("result") and (block.get("is_error") is True) == \
                bool(obs.get("is_error")):
            continue
        expected = {"name": obs["name"], "args": obs.get("args"), "result": obs.get("result")}
        actual = {**expected, "result": got}
        if block.get("is_error") is True:
            actual["is_error"] = True
        if obs.get("is_error"):
            expected["is_error"] = True
        info = DivergenceInfo(
            step=obs["seq"], kind=Kind.TOOL.value,
            reason=f"the agent's tool {obs['name']!r} returned something other than "
                   f"the recorded result (call {block['tool_use_id']})",
            expected=expected, actual=actual, diff=unified(expected, actual))
        served: Any = getattr(run.session, "prefix", run.session)  # a fork: its prefix
        if getattr(served, "divergence", None) is None:
            served.divergence = info
        raise Divergence(info, path=getattr(served, "path", None))


def substitute(body: dict[str, Any], edits: dict[str, Any], raw: bytes) -> bytes:
    """The request with each edited tool result in place of what the agent sent (a fork
    at a tool step: the model sees the edit in every later request too)."""
    changed = False
    for message in conversation_items(body) or []:
        if not isinstance(message, dict):
            continue
        if message.get("role") == "tool":  # OpenAI Chat Completions: the message is the result
            targets = [(message, message.get("tool_call_id"), "content")]
        elif message.get("type") == "function_call_output":  # a Responses item: the result
            targets = [(message, message.get("call_id"), "output")]
        else:
            targets = [(block, block.get("tool_use_id"), "content")
                       for block in tool_results([message])]  # Anthropic tool_result blocks
        for target, call, key in targets:
            if isinstance(call, str) and call in edits and target.get(key) != edits[call]:
                target[key] = edits[call]
                changed = True
    if not changed:
        return raw
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def is_responses(path: str) -> bool:
    """Is this a call of the OpenAI Responses API (``POST /v1/responses``)?"""
    return path.rstrip("/").endswith("/responses")


def read_reply(registry: Registry, run: ProxyRun, seam: providers.Provider,
               headers: list[tuple[str, str]], body: bytes) -> None:
    """What a Responses API reply means for the run's boundaries: the function calls
    it asks for (a request continuing it by ``previous_response_id`` sends their
    results without them), whether it waits for their results (how an idle run ends),
    and its id, by which such a request finds the run."""
    try:
        message = seam.message(headers, body)
    except ValueError:
        return
    output = message.get("output") if isinstance(message, dict) else None
    if not isinstance(output, list):
        return
    asked = tool_calls(output)
    run.calls.update(asked)
    run.awaiting_tools = bool(asked)
    if isinstance(message.get("id"), str):
        registry.replied(run, message["id"])
