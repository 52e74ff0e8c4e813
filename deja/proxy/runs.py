"""Which run a proxied request belongs to, and what a run sees at its boundaries.

A run is one cassette. A client names its run with an ``x-deja-run: NAME`` header (and
may label it with ``x-deja-labels: key=value, key=value`` on its first request); requests
with the same name and the same API key go to the same run while it is open. Without a
name, a run is one conversation:

- a model request whose conversation starts with every message of an open run's last
  request, and add at least one, joins that run (the longest such run wins; among equals
  the one with no call in flight, then the one used last);
- a request that repeats an open run's last request exactly joins it only when it is a
  retry: the SDKs say so (``x-stainless-retry-count`` above 0); a client that does not
  say is taken to retry when that request failed or is still in flight;
- anything else starts a new run. A request that is not a model call (``count_tokens``,
  ``/v1/models``) joins the API key's most recently used open run, else starts one.

Runs are told apart by API key as well: two clients with different keys never share a
run (the key is hashed in memory, never written). An open run with no request for
``idle`` seconds is closed with its end line: ``completed`` when its last model response
ended the turn, else ``interrupted`` (the agent went away mid-loop).

The limits of the rule: two clients that send the very same conversation at the same
time cannot be told apart without a name (each lands in a run of its own only while their
histories differ); an agent that rewrites its history (summarising, trimming) starts a new
run at that point. Name runs with ``x-deja-run`` where that matters.

Which list holds a request's conversation is its provider's to say
(:func:`conversation_items`): the OpenAI Responses API carries it in ``input``, Gemini in
``contents``, and each is found again the same way when the agent resends its items; an
agent that continues a Responses reply by ``previous_response_id`` instead sends only
what is new, and joins the run that response came from (:meth:`Registry.replied`).

Tools: the proxy never sees a tool run, but it sees its result in the next request, and
the call that asked for it in the assistant turn just before (or in the response a
``previous_response_id`` continues), both read through the request's conversation
(:mod:`recorder.providers.conversation`): an Anthropic ``tool_result`` block and its
``tool_use``, an OpenAI ``role: tool`` message and its ``tool_calls`` entry, a Responses
``function_call_output`` and its ``function_call``, a Gemini ``functionResponse`` and its
``functionCall`` (paired by the function's name when the model gave the call no id). Each
new result is logged as a ``tool`` line marked ``observed``
(:meth:`recorder.record.RecordSession.observe_tool`), and the loop guard sees it there.

A named run may hold several conversations (:class:`Dialogues`): each request continues
the one whose history it extends. A tool result's id is unique in the run, not only in its
conversation: Gemini names a call by its function when the model gives it no id, so two
conversations of a run may both answer a ``lookup`` (and a ``lookup#2``, their second);
the second conversation's are numbered on in the run (``lookup#3``, ``lookup#4``), as
later ``lookup`` results of one conversation are. A run of one conversation keeps the ids
its conversation gives.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import re
import threading
import time
from collections.abc import AsyncIterator, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from recorder import providers
from recorder.capture.session import Session
from recorder.cassette.schema import EndStatus, Kind
from recorder.errors import RunStopped
from recorder.providers import Provider, conversation
from recorder.record import RecordSession

if TYPE_CHECKING:
    from deja.proxy._then_live import AgentTools, Following

__all__ = ["Dialogue", "Dialogues", "ProxyRun", "Registry", "Starting", "calls_by_id",
           "conversation_items", "credential", "mcp_call_key", "message_keys", "parse_labels",
           "start_key", "substituted", "tool_calls", "tool_results"]

log = logging.getLogger("deja.proxy")

RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:@-]{0,127}$")


# Where the clients deja proxies send their key: Anthropic, OpenAI (a bearer token),
# Gemini, Azure OpenAI.
_KEY_HEADERS = frozenset({"x-api-key", "authorization", "x-goog-api-key", "api-key"})


def credential(headers: Sequence[tuple[str, str]]) -> str:
    """Who is calling, as a hash of its API key (never stored): runs are kept apart by it."""
    h = hashlib.sha256()
    for name, value in headers:
        if name.lower() in _KEY_HEADERS:
            h.update(name.lower().encode() + b"\0" + value.encode("utf-8", "replace") + b"\0")
    return h.hexdigest()[:16]


def parse_labels(value: str | None) -> dict[str, str]:
    """``key=value, key=value`` (an ``x-deja-labels`` header) as a dict."""
    out: dict[str, str] = {}
    for item in (value or "").split(","):
        key, sep, val = item.strip().partition("=")
        if sep and key.strip():
            out[key.strip()] = val.strip()
    return out


def message_keys(messages: Sequence[Any], texts: Sequence[str] | None = None) -> list[str]:
    """One short key per message: the hash of its exact text when the body's texts are
    known (a conversation resends its history byte for byte), else of its JSON."""
    if texts is not None and len(texts) == len(messages):
        return [hashlib.blake2b(t.encode("utf-8", "surrogatepass"), digest_size=12).hexdigest()
                for t in texts]
    return [hashlib.blake2b(json.dumps(m, sort_keys=True, separators=(",", ":"),
                                       ensure_ascii=False).encode("utf-8", "surrogatepass"),
                            digest_size=12).hexdigest() for m in messages]


def conversation_items(body: Mapping[str, Any],
                       seam: Provider | None = None) -> list[Any] | None:
    """The list a model request carries its conversation in, as its provider (``seam``;
    when not given, the first registered provider that finds one) names it: the Messages
    API's and Chat Completions' ``messages``, the Responses API's ``input`` items (an
    ``input`` string is one user message), Gemini's ``contents``; None when the request
    has none."""
    history = seam.history_field(body) if seam is not None else providers.history_field(body)
    if history is not None:
        items: list[Any] = body[history]
        return items
    given = body.get("input")
    return [{"role": "user", "content": given}] if isinstance(given, str) else None


def tool_calls(items: list[Any]) -> dict[str, tuple[str, Any]]:
    """The tool calls of the assistant turns among history ``items`` read without their
    request (:func:`recorder.providers.conversation.read_history`): id -> (name, input),
    ids made unique (:func:`~recorder.providers.conversation.numbered_calls`). Anthropic
    ``tool_use`` blocks, OpenAI Chat Completions ``tool_calls`` and Responses
    ``function_call`` items (by their ``call_id``), Gemini ``functionCall`` parts; OpenAI's
    arguments, JSON text, parsed (kept as the text when they are not JSON)."""
    read = conversation.read_history(items)
    if read is None:
        return {}
    provider, body = read
    return calls_by_id(conversation.numbered_calls(
        conversation.turns(provider.conversation(body))))


def calls_by_id(calls: list[conversation.ToolCall]) -> dict[str, tuple[str, Any]]:
    """id -> (name, input) of ``calls`` that have an id."""
    return {call.id: (str(call.name), call.input) for call in calls if call.id is not None}


def tool_results(items: list[Any]) -> list[dict[str, Any]]:
    """The tool results the agent sent among history ``items`` (read as :func:`tool_calls`
    reads them), in order, as ``tool_result`` blocks of their call's id, the content as
    sent and whether it is an error: Anthropic ``tool_result`` blocks of the user's
    messages, OpenAI's ``role: tool`` messages and Responses ``function_call_output``
    items, Gemini's ``functionResponse`` parts (each a new block: editing it leaves the
    items as they were)."""
    read = conversation.read_history(items)
    if read is None:
        return []
    return [{"type": conversation.BlockKind.TOOL_RESULT.value,
             "tool_use_id": placed.result.tool_use_id, "content": placed.sent,
             "is_error": placed.result.is_error}
            for placed in conversation.placed_results(*read)
            if placed.result.tool_use_id is not None]


@dataclass(eq=False)
class Dialogue:
    """One conversation of a run, as its last request left it: its message keys, how many
    times each tool-use id has come up in it so far (the next one is numbered from there,
    as :func:`recorder.providers.conversation.numbered_calls` numbers a whole request), and
    the ids its tool results have in the run."""

    keys: list[str]
    calls: dict[str, int] = field(default_factory=dict)  # call id -> its uses so far
    results: dict[str, int] = field(default_factory=dict)  # result id -> its uses so far
    ids: dict[str, str] = field(default_factory=dict)  # result id, numbered -> the run's
    used: int = 0  # when it was last continued (an order)
    settled: bool = False  # its last request was answered (whole, a status below 400)


class Dialogues:
    """The conversations of one run, each found again by the history its next request
    resends (an unnamed run holds one; a named run one per conversation its client had
    through it), and the tool-result ids the run has given out."""

    def __init__(self) -> None:
        self._tails: dict[tuple[int, str], list[Dialogue]] = {}
        self._clock = 0
        self.given: dict[str, int] = {}  # a result's id in its conversation -> times given
        self.taken: set[str] = set()  # the ids given

    def find(self, keys: list[str], retry: bool | None = None) -> Dialogue | None:
        """The conversation a request of message ``keys`` continues: the one whose last
        request is the longest start of it (the latest continued among equals); None: the
        request starts one. A conversation's last request sent again is its retry when the
        client says so (``retry``: the SDKs' ``x-stainless-retry-count``) or, when it does
        not say, when that request had no answer (failed, or still in flight); else it is
        another conversation that repeats this one word for word so far, and continues the
        one it extends, if any (the same request again adds nothing either way). A probe
        per message at most, longest first."""
        again = self._ending(keys, len(keys))
        unsettled = [d for d in again if not d.settled]
        if again and (retry or (retry is None and unsettled)):
            return _latest(again if retry else unsettled)
        for n in range(len(keys) - 1, 0, -1):
            found = self._ending(keys, n)
            if found:
                return _latest(found)
        return _latest(again) if again else None

    def _ending(self, keys: list[str], n: int) -> list[Dialogue]:
        """The conversations whose last request is ``keys``' first ``n`` messages."""
        if n == 0:
            return []
        return [d for d in self._tails.get((n, keys[n - 1]), ()) if d.keys == keys[:n]]

    def advance(self, dialogue: Dialogue | None, keys: list[str]) -> Dialogue:
        """``dialogue`` (a new one when None) now ends with the request of ``keys``."""
        if dialogue is None:
            dialogue = Dialogue(keys)
        else:
            listed = self._tails.get((len(dialogue.keys), dialogue.keys[-1])) \
                if dialogue.keys else None
            if listed is not None and dialogue in listed:
                listed.remove(dialogue)
        dialogue.keys = keys
        self._clock += 1
        dialogue.used, dialogue.settled = self._clock, False
        if keys:
            self._tails.setdefault((len(keys), keys[-1]), []).append(dialogue)
        return dialogue

    def fresh(self, raw: str, local: str, pending: Mapping[str, str]) -> str:
        """The run's id for a new result whose id is ``raw`` (``local`` as its conversation
        numbers it): ``local`` unless the run has given it (to another conversation's
        result), else the next of ``raw#2``, ``raw#3`` ... not given, counting those a
        request is giving (``pending``: run id -> ``raw``) too. A run of one conversation
        keeps its conversation's ids."""
        if local not in self.taken and local not in pending:
            return local
        n = self.given.get(raw, 0) + sum(given == raw for given in pending.values())
        while True:
            n += 1
            candidate = raw if n == 1 else f"{raw}#{n}"
            if candidate not in self.taken and candidate not in pending:
                return candidate

    def take(self, given: Mapping[str, str]) -> None:
        """The ids a request gave (run id -> its id in its conversation) are the run's."""
        for run_id, raw in given.items():
            self.given[raw] = self.given.get(raw, 0) + 1
            self.taken.add(run_id)


def _latest(dialogues: list[Dialogue]) -> Dialogue:
    return max(dialogues, key=lambda d: d.used)


def mcp_call_key(name: Any, args: Any) -> tuple[str, str]:
    """A tool call as an MCP ``tools/call`` and the model's tool call that asked for it
    both name it: the tool's name, and its arguments as canonical JSON."""
    return str(name), json.dumps({} if args is None else args, sort_keys=True,
                                 separators=(",", ":"), default=str)


def _same_tool(asked: str, called: str) -> bool:
    """The model's tool ``asked`` is the MCP tool ``called``: the same name, or the name
    with a prefix an agent gave its MCP tools (``ledger__lookup``, ``ledger.lookup``)."""
    return asked == called or (asked.endswith(called)
                               and not asked[-len(called) - 1].isalnum())


def substituted(obs: Mapping[str, Any]) -> bool:
    """Is ``obs`` an observed tool line whose result the model was given in place of what
    the agent sent: a fork's edit, or the answer of a replay-then-live's tool policy
    (``static``, ``recorded``)? A replay puts it in place again."""
    return bool(obs.get("edited")) or "policy" in obs


@dataclass
class ProxyRun:
    """One run seen through the proxy: its session, and what its boundaries need."""

    session: Session  # a RecordSession, a ContinuationSession (fork) or a ReplaySession
    name: str | None = None
    who: str = ""
    _keys: list[str] = field(default_factory=list, repr=False)
    _registry: Registry | None = field(default=None, repr=False)
    last_failed: bool = False
    last_stop_reason: Any = None
    in_flight: int = 0
    used: float = field(default_factory=time.monotonic)
    answered: float | None = None  # when the last response ended (epoch seconds)
    logged: set[str] = field(default_factory=set)  # tool call ids with a line already
    dialogues: Dialogues = field(default_factory=Dialogues, repr=False)
    edits: dict[str, Any] = field(default_factory=dict)  # call id -> edited result (a fork)
    # call id -> whether the result given in the agent's place is an error
    edit_errors: dict[str, bool] = field(default_factory=dict)
    # call id -> the observed tool line a served run recorded for it (replay, a fork's prefix)
    recorded: dict[str, Mapping[str, Any]] = field(default_factory=dict)
    # a replay-then-live's recording, followed while the agent asks what it asked before
    following: Following | None = None
    # the tool policy of a fork's or a replay-then-live's live part over the agent's tools
    policy: AgentTools | None = None
    # call id -> (name, input) of the function calls its Responses replies asked for: a
    # request that continues one by previous_response_id sends the results, not the calls
    calls: dict[str, tuple[str, Any]] = field(default_factory=dict)
    # its last reply left the turn to the agent (asked for tools); None: not read
    awaiting_tools: bool | None = None
    response_ids: list[str] = field(default_factory=list)  # its Responses replies' ids
    stopped: RunStopped | None = None
    closed: bool = False
    model: bool = False  # it has had a model request
    mcp: bool = False  # it has had an MCP session (deja proxy --mcp)
    mcp_sessions: set[str] = field(default_factory=set)  # its MCP sessions still open
    # the MCP tool calls (name, arguments) it made through the proxy that no model request
    # has carried the result of yet: that result is the MCP call's, already a step
    mcp_calls: list[tuple[str, str]] = field(default_factory=list)
    cut: bool = False  # a call was cut short by the proxy's shutdown
    # held while a large line of the run is written in a worker thread: the run's next
    # request waits for it, so that its lines keep their order
    logging: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)

    def called_over_mcp(self, name: Any, args: Any) -> None:
        """Note a ``tools/call`` made through the proxy's MCP endpoint (the last 256: a
        client that talks to no model through the proxy never carries their results)."""
        self.mcp_calls.append(mcp_call_key(name, args))
        del self.mcp_calls[:-256]

    def took_over_by_mcp(self, name: str, args: Any) -> bool:
        """The tool call ``name(args)`` whose result a model request carries was made
        through the proxy's MCP endpoint (it is a step already): forget it there, True."""
        _, wanted = mcp_call_key(name, args)
        for n, (called, given) in enumerate(self.mcp_calls):
            if given == wanted and _same_tool(name, called):
                del self.mcp_calls[n]
                return True
        return False

    @property
    def last_keys(self) -> list[str]:
        """The message keys of the run's last model request (how a conversation is
        found again: :meth:`Registry.find`)."""
        return self._keys

    @last_keys.setter
    def last_keys(self, keys: list[str]) -> None:
        old, self._keys = self._keys, keys
        if self._registry is not None:
            self._registry.rekey(self, old)

    @property
    def run_id(self) -> str:
        rid = getattr(self.session, "run_id", None)
        if rid is None:  # a replay serves the recorded run
            rid = getattr(getattr(self.session, "cassette", None), "run", "?")
        return str(rid)

    @property
    def recording(self) -> RecordSession | None:
        """The session that writes this run, while it writes (None: it only serves)."""
        return self.session.recorder() if self.session.writing_live() else None

    def remember(self, observations: Sequence[Mapping[str, Any]], *,
                 logged: bool = True) -> None:
        """The tool calls a recorded run holds (a replay, a fork's prefix, a
        replay-then-live's parent): checked against what the agent sends while they are
        served, and those whose result the model was given in the agent's place (an edit,
        a tool policy's answer: :func:`substituted`) put in every request that carries
        them. ``logged``: they are lines of this run already (a replay-then-live logs them
        anew, as it copies the recording)."""
        for obs in observations:
            call = obs.get("call_id")
            if obs.get("kind") == Kind.TOOL and "observed" in obs and isinstance(call, str):
                if logged:
                    self.logged.add(call)
                self.recorded[call] = obs
                if substituted(obs):
                    self.edits[call] = obs.get("result")
                    self.edit_errors[call] = bool(obs.get("is_error"))

    def end_status(self) -> tuple[str, str | None]:
        """How an idle or shut-down run ends: completed when its last turn ended. Whether
        it did is its last reply's to say, as its provider reads it (it asks for tools:
        an Anthropic ``tool_use``, OpenAI ``tool_calls``, a Gemini ``functionCall``, which
        stops with ``STOP`` all the same); of a reply not read, its stop reason's."""
        if self.cut:
            return EndStatus.INTERRUPTED, "a call was cut short when the proxy shut down"
        if self.last_failed:
            return EndStatus.ERROR, "its last call failed"
        if self.mcp and not self.model:  # MCP calls only: each ended with its answer
            return EndStatus.COMPLETED, None
        if self.awaiting_tools:
            return EndStatus.INTERRUPTED, "its last response asked for tools, whose " \
                "results never came"
        if self.last_stop_reason is None or (self.awaiting_tools is None and
                                             conversation.stop_unfinished(
                                                 self.last_stop_reason)):
            return EndStatus.INTERRUPTED, "no request came after its last response"
        return EndStatus.COMPLETED, None


class Registry:
    """The open runs of a proxy, found by name or by conversation. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.runs: list[ProxyRun] = []
        self.names: dict[tuple[str, str], ProxyRun] = {}
        # unnamed runs by (API key, message count, last message key) of their last request:
        # finding the run a request extends costs a lookup per message, not a scan of runs
        self._tails: dict[tuple[str, int, str], list[ProxyRun]] = {}
        # stopped runs, kept for a while: a client that keeps sending gets the stop again
        self.stopped: list[ProxyRun] = []
        # the run each Responses reply came from, by (API key, response id)
        self._responses: dict[tuple[str, str], ProxyRun] = {}

    def __len__(self) -> int:
        return len(self.runs)

    def find(self, who: str, name: str | None, keys: list[str] | None,
             retry: bool | None = None, previous: str | None = None) -> ProxyRun | None:
        """The open (or stopped) run a request belongs to; None: it starts one. ``retry``:
        whether the client says this is a retry (the SDKs' ``x-stainless-retry-count``),
        None when it does not say; ``previous``: the Responses reply the request continues
        (its ``previous_response_id``), whose run it joins."""
        with self._lock:
            if name is not None:
                return self.names.get((who, name))
            if previous is not None and (who, previous) in self._responses:
                return self._responses[(who, previous)]
            if keys is None:  # not a model call: the caller's latest run
                mine = [r for r in self.runs if r.who == who]
                return max(mine, key=lambda r: r.used) if mine else None
            return self._by_history(who, keys, retry)

    def _by_history(self, who: str, keys: list[str], retry: bool | None) -> ProxyRun | None:
        for n in range(len(keys), 0, -1):  # the longest history first
            best: ProxyRun | None = None
            for run in self._tails.get((who, n, keys[n - 1]), ()):
                if run.last_keys != keys[:n]:
                    continue
                if n == len(keys) and (retry is False or (
                        retry is None and not run.last_failed and run.in_flight == 0)):
                    continue  # the same request again, not a retry: a new conversation
                if best is None or (run.in_flight == 0, run.used) > \
                        (best.in_flight == 0, best.used):
                    best = run
            if best is not None:
                return best
        return None

    def latest(self, name: str | None) -> ProxyRun | None:
        """The open run named ``name`` (by any caller), or without a name the one used
        last: where an MCP session joins (its client sends no model API key)."""
        with self._lock:
            runs = [r for r in self.runs if name is None or r.name == name]
            return max(runs, key=lambda r: r.used) if runs else None

    def waiting(self) -> ProxyRun | None:
        """The open unnamed run used last that has MCP sessions and no model request yet:
        the run an agent's first model request joins when it opened its MCP session
        first."""
        with self._lock:
            runs = [r for r in self.runs if r.mcp and not r.model and r.name is None]
            return max(runs, key=lambda r: r.used) if runs else None

    def replied(self, run: ProxyRun, response_id: str) -> None:
        """``run`` got the Responses reply ``response_id``: a request that continues it
        (``previous_response_id``) joins ``run`` while it is open."""
        with self._lock:
            if run.closed and run not in self.stopped:
                return
            run.response_ids.append(response_id)
            self._responses[(run.who, response_id)] = run

    def _forget_replies(self, run: ProxyRun) -> None:
        for response_id in run.response_ids:
            if self._responses.get((run.who, response_id)) is run:
                del self._responses[(run.who, response_id)]

    def _tail(self, run: ProxyRun, keys: list[str]) -> tuple[str, int, str] | None:
        return (run.who, len(keys), keys[-1]) if keys and run.name is None else None

    def rekey(self, run: ProxyRun, old: list[str]) -> None:
        """``run``'s last request changed from ``old`` to ``run.last_keys``."""
        with self._lock:
            self._untail(run, old)
            new = self._tail(run, run.last_keys)
            if new is not None:
                self._tails.setdefault(new, []).append(run)

    def _untail(self, run: ProxyRun, keys: list[str]) -> None:
        tail = self._tail(run, keys)
        listed = self._tails.get(tail) if tail is not None else None
        if listed is not None and run in listed:
            listed.remove(run)
            if not listed:
                del self._tails[tail]  # type: ignore[arg-type]

    def add(self, run: ProxyRun) -> None:
        with self._lock:
            self.runs.append(run)
            if run.name is not None:
                self.names[(run.who, run.name)] = run
            run._registry = self
            self.rekey(run, [])

    def retire(self, run: ProxyRun, *, keep: bool) -> None:
        """Take a closed run off the open list; ``keep`` it among the stopped ones."""
        with self._lock:
            if run in self.runs:
                self.runs.remove(run)
            if run.name is not None and self.names.get((run.who, run.name)) is run and not keep:
                del self.names[(run.who, run.name)]
            if keep:
                self.stopped.append(run)
            else:
                self._untail(run, run.last_keys)
                self._forget_replies(run)

    def idle(self, older_than: float) -> list[ProxyRun]:
        """Open runs with nothing in flight, last used before ``older_than``."""
        with self._lock:
            return [r for r in self.runs if r.in_flight == 0 and r.used < older_than]

    def forget_stopped(self, older_than: float) -> None:
        with self._lock:
            gone = [r for r in self.stopped if r.used < older_than]
            for run in gone:
                self.stopped.remove(run)
                self._untail(run, run.last_keys)
                self._forget_replies(run)
                if run.name is not None and self.names.get((run.who, run.name)) is run:
                    del self.names[(run.who, run.name)]

    def open_runs(self) -> list[ProxyRun]:
        with self._lock:
            return list(self.runs)


def start_key(who: str, name: str | None, keys: list[str] | None) -> Hashable:
    """What two requests that could start (or join) the same new run share: their caller,
    and the run's name, else the first message of the conversation (a request that extends
    or repeats another starts with the same one), else nothing more (not a model call)."""
    if name is not None:
        return who, "name", name
    return who, "first", keys[0] if keys else None


class Starting:
    """The runs being started, one lock per :func:`start_key`: two requests that could
    start the same run take turns (the second finds the first's run), while the first
    requests of other conversations start theirs at once, their cassettes' headers forced
    to disk side by side instead of one after another."""

    def __init__(self) -> None:
        self._locks: dict[Hashable, tuple[asyncio.Lock, int]] = {}

    def __len__(self) -> int:
        return len(self._locks)

    @contextlib.asynccontextmanager
    async def of(self, key: Hashable) -> AsyncIterator[None]:
        lock, users = self._locks.get(key) or (asyncio.Lock(), 0)
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[key]
            if users == 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)
