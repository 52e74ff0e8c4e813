"""A stub script that answers what a recorded run received (``deja stub --from CASSETTE``).

Any recording becomes a stub model: each Anthropic Messages call of the cassette becomes a
rule of the script (:mod:`recorder.testing.script`) that answers the same place in the same
conversation with the response the run received, as it arrived: a JSON message as
``message``, an event stream verbatim as ``sse``, an error with its status, type, message and
retry headers as ``error``, a call that got no response as ``drop``.

A rule matches a request by its conversation, not by a counter: ``position`` (how many
assistant replies the request carries) and ``first_user`` (the text of the conversation's
first user message). When the run sent two different requests at the same place of the same
conversation, each gets a rule that also names its ``last_user`` text, and the first of them
answers whatever else arrives there. The attempts of one request (the same request sent
again by the SDK after a 429 or 529) become a retry sequence: the first failure, then ``then``
up to the first response that was not a failure, served by the SDK's attempt header. So the
script holds no state: a second run, a fork or a resume gets the same answers.

Only the first success of a request is kept: an identical request sent again later, not as a
retry, gets that answer too, since nothing in the request tells the two apart.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from recorder import providers
from recorder.canonical import content_decoded, decode_body
from recorder.cassette.schema import Kind
from recorder.providers import conversation
from recorder.testing.match import first_user_text, is_failure, last_user_text, position
from recorder.testing.script import StubScriptError

if TYPE_CHECKING:
    from recorder.cassette import Cassette

__all__ = ["CassetteScript", "recorded_turn", "retry_chain", "script_from_cassette"]

# The response headers that make a client wait or give up; kept on a recorded error.
RETRY_HEADERS = ("retry-after", "retry-after-ms", "x-should-retry")


@dataclass(frozen=True)
class CassetteScript:
    """A stub script made from a cassette, and what went into it."""

    script: dict[str, Any]
    run: str
    calls: int  # the Anthropic Messages calls (attempts included) the rules answer
    skipped: tuple[str, ...]  # the model calls left out, each with why

    def text(self) -> str:
        """The script as a JSON file's text."""
        return json.dumps(self.script, indent=2, ensure_ascii=False) + "\n"


@dataclass
class _Request:
    """One distinct request at a place of a conversation, with its recorded attempts."""

    last_user: str
    answers: list[tuple[int, dict[str, Any]]]  # (seq, turn), in recorded order


# The providers whose calls a stub answers: the Messages format (Anthropic's API and
# Bedrock's, which the stub matches alike), OpenAI's and Gemini's. A plugin provider's run
# is served back by ``deja proxy --replay`` instead.
STUB_PROVIDERS = frozenset({"anthropic", "bedrock", "openai", "gemini"})
_MESSAGES_PROVIDERS = ("anthropic", "bedrock")


def _is_messages_call(obs: Mapping[str, Any]) -> bool:
    name = obs.get("provider") or "anthropic"
    return name in _MESSAGES_PROVIDERS and providers.get(str(name)).is_model_call(
        "POST", str(obs.get("url") or ""))


def _error_turn(status: int, headers: dict[str, str], text: str) -> dict[str, Any]:
    err: dict[str, Any] = {"status": status}
    try:
        doc = json.loads(text) if text else None
    except ValueError:
        doc = None
    detail = doc.get("error") if isinstance(doc, dict) else None
    if isinstance(detail, dict):
        for key in ("type", "message"):
            if isinstance(detail.get(key), str) and detail[key]:
                err[key] = detail[key]
    retry = {name: headers[name] for name in RETRY_HEADERS if name in headers}
    if retry:
        err["headers"] = retry
    return {"error": err}


def _holds_a_reply(provider: providers.Provider, body: Any, doc: Any) -> bool:
    """Is ``doc`` a response message of its provider's format, as the conversation reads
    it: a reply with content, or one that says why it stopped?"""
    if not isinstance(doc, dict):
        return False
    answer = conversation.reply(provider.conversation(body, doc))
    return bool(conversation.blocks(answer)) or provider.stop_reason(doc) is not None


def recorded_turn(obs: Mapping[str, Any], body: Any) -> tuple[dict[str, Any] | None, str]:
    """The script turn that sends what model call ``obs`` (its request ``body``) received,
    whatever its provider, or None and why it cannot: a JSON reply as ``message``, a
    stream verbatim as ``sse``, an error with its status, type, message and retry
    headers, no response as a ``drop``. The body is read as the SDK reads it (a
    compressed one decompressed)."""
    response = obs.get("response")
    if response is None:
        return {"drop": "before_headers"}, ""
    status = response.get("status")
    headers = [(str(k), str(v)) for k, v in response.get("headers") or []]
    raw = content_decoded(decode_body(response.get("body", ""), response.get("encoding")),
                          headers)
    provider = providers.for_line(obs)
    streamed = provider.is_stream(headers)
    try:  # a stream as its events' text, whatever its framing (Bedrock's is binary)
        text = provider.stream_text(raw) if streamed else raw.decode("utf-8")
    except UnicodeDecodeError:
        return None, "its response body is not UTF-8"
    if isinstance(status, int) and 400 <= status <= 599:
        return _error_turn(status, {k.lower(): v for k, v in headers}, text), ""
    if status != 200:
        return None, f"its response has status {status}"
    if streamed:
        if "data:" not in text:
            return None, "its event stream holds no event"
        return {"sse": text}, ""
    try:
        doc = json.loads(text)
    except ValueError:
        return None, "its response body is not JSON"
    if not _holds_a_reply(provider, body, doc):
        return None, f"its response holds no reply its provider ({provider.name}) reads"
    return {"message": doc}, ""


def retry_chain(answers: list[tuple[int, dict[str, Any]]]) -> dict[str, Any]:
    """The failures of a request's attempts up to its first success, as one retry turn."""
    used: list[tuple[int, dict[str, Any]]] = []
    for seq, turn in answers:
        used.append((seq, turn))
        if not is_failure(turn):
            break
    first = dict(used[0][1])
    if is_failure(first) and len(used) > 1:
        first["then"] = [turn for _, turn in used[1:]]
    return {"_seq": [seq for seq, _ in used], **first}


def script_from_cassette(cassette: Cassette) -> CassetteScript:
    """A script answering every Messages call of ``cassette`` (Anthropic's API or Bedrock's)
    as it was answered.

    ``cassette`` is a loaded cassette (:func:`recorder.cassette.load`, which checks its
    signature). Raises :class:`StubScriptError` when it holds no such call.
    """
    places: dict[tuple[str, int], dict[str, _Request]] = {}
    skipped: list[str] = []
    calls = 0
    for obs in cassette.observations:
        if obs.get("kind") != Kind.MODEL:
            continue
        seq = obs["seq"]
        if not _is_messages_call(obs):
            skipped.append(f"seq {seq}: {obs.get('url')} is not the Messages API "
                           "(Anthropic's or Bedrock's)")
            continue
        body = cassette.request_of(seq)
        if not isinstance(body, dict) or not conversation.turns(
                providers.for_line(obs).conversation(body)):
            skipped.append(f"seq {seq}: its request has no messages")
            continue
        turn, why = recorded_turn(obs, body)
        if turn is None:
            skipped.append(f"seq {seq}: {why}")
            continue
        calls += 1
        requests = places.setdefault((first_user_text(body), position(body)), {})
        request = requests.setdefault(str(obs.get("fp")), _Request(last_user_text(body), []))
        request.answers.append((seq, turn))
    if not places:
        raise StubScriptError(
            f"{cassette.path}: run {cassette.run} holds no Anthropic Messages call (POST "
            "/v1/messages) a stub can answer"
            + (f" ({'; '.join(skipped)})" if skipped else "")
            + "; record the agent against an Anthropic API to make a stub of it"
        )
    rules: list[dict[str, Any]] = []
    for (first_user, at), requests in places.items():
        when = {"position": at, "first_user": first_user}
        distinct = list(requests.values())
        if len(distinct) > 1:
            seen: set[str] = set()
            for request in distinct:
                if request.last_user in seen:
                    continue  # told apart by nothing the rules look at: the first answers
                seen.add(request.last_user)
                rules.append({"when": {**when, "last_user": request.last_user},
                              **retry_chain(request.answers)})
        rules.append({"when": when, **retry_chain(distinct[0].answers)})
    script = {
        "_note": f"Generated by deja stub --from {cassette.path.name} (run {cassette.run}): "
                 "each rule answers a place in a conversation with what the run received "
                 "there; _seq names the cassette steps.",
        "select": "conversation",
        "rules": rules,
    }
    return CassetteScript(script=script, run=cassette.run, calls=calls,
                          skipped=tuple(skipped))
