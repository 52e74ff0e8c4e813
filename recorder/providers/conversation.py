"""deja's conversation shape, read through typed accessors.

:meth:`Provider.conversation` reads a model call of any provider as a
:class:`~recorder.providers.base.Conversation` in the Messages API's shape. This module is
how the rest of deja reads that shape, so that no module outside this package names a
wire key:

- a block's kind (:class:`BlockKind`, :func:`kind`) and what it holds: its text, the tool
  call (:class:`ToolCall`) or result (:class:`ToolResult`) it is, its image;
- a turn's role, blocks, text, tool calls and results; a conversation's turns, system
  prompt, reply and settings, and the conversation as one request-shaped document (what
  ``deja diff`` compares, :func:`as_request`);
- tool-use ids as a comparison needs them: replaced by their order of first use
  (:func:`stable_ids`; they are random in every run), or made unique within a
  conversation (:func:`numbered_calls`, :func:`numbered_results`: Gemini names a call by
  its function when the model gives it no id, so one function called twice repeats it);
- whether a reply leaves the turn to the agent (:func:`reply_unfinished`);
- for a request whose provider is not known (the proxy reads a body before it knows
  which API it is in), the provider whose format reads it (:func:`reader_of`), and where
  each tool result sits in the request as sent (:func:`placed_results`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from recorder.providers import registry
from recorder.providers.base import Conversation, Provider

__all__ = ["BlockKind", "Image", "PlacedResult", "ResultSlot", "ToolCall", "ToolResult",
           "as_blocks", "as_request", "blocks", "kind", "numbered_calls", "numbered_results",
           "placed_results", "read_history", "reader_of", "reply", "reply_unfinished",
           "request_turns", "role", "settings", "stable_ids", "stop_unfinished", "system",
           "text", "text_of", "tool_call", "tool_calls", "tool_names", "tool_result",
           "tool_results", "turns", "type_name"]

Turn = Mapping[str, Any]


class BlockKind(StrEnum):
    """What a block of a turn is. Being a ``StrEnum``, a member is the block type's very
    string (``BlockKind.TOOL_USE == "tool_use"``)."""

    TEXT = "text"
    THINKING = "thinking"
    REDACTED_THINKING = "redacted_thinking"
    IMAGE = "image"
    TOOL_USE = "tool_use"  # a tool the agent runs
    TOOL_RESULT = "tool_result"  # what the agent's tool returned
    SERVER_TOOL_USE = "server_tool_use"  # a tool the API runs itself (a web search)
    SERVER_TOOL_RESULT = "server_tool_result"  # its result (``web_search_tool_result`` ...)
    OTHER = "other"  # anything else, kept as it is


_NAMED = frozenset({BlockKind.TEXT, BlockKind.THINKING, BlockKind.REDACTED_THINKING,
                    BlockKind.IMAGE, BlockKind.TOOL_USE, BlockKind.TOOL_RESULT,
                    BlockKind.SERVER_TOOL_USE})
_CALLS = (BlockKind.TOOL_USE, BlockKind.SERVER_TOOL_USE)


@dataclass(frozen=True)
class ToolCall:
    """A tool call a model asked for: its id (None: it has none that is a string), the
    tool's name and its input, parsed."""

    id: str | None
    name: str | None
    input: Any


@dataclass(frozen=True)
class ToolResult:
    """What a tool returned, as the conversation holds it: the id of the call it answers,
    the tool's name when the format says it (Gemini's do), the content (a string, blocks,
    or any value) and whether it is an error."""

    tool_use_id: str | None
    name: str | None
    content: Any
    is_error: bool


@dataclass(frozen=True)
class Image:
    """An image block's source: base64 ``data`` with its media type, or a ``url``
    (``source_type`` says which; another source has neither)."""

    source_type: str | None
    media_type: str | None
    data: str | None
    url: str | None


# ---------------------------------------------------------------------- blocks


def kind(block: Any) -> BlockKind:
    """The kind of ``block`` (a string is text; a block of a type deja does not lay out
    is :attr:`BlockKind.OTHER`)."""
    if isinstance(block, str):
        return BlockKind.TEXT
    name = type_name(block)
    if name is None:
        return BlockKind.OTHER
    if name in _NAMED:
        return BlockKind(name)
    if name.endswith("_tool_use"):  # mcp_tool_use
        return BlockKind.SERVER_TOOL_USE
    return BlockKind.SERVER_TOOL_RESULT if name.endswith("_tool_result") else BlockKind.OTHER


def type_name(block: Any) -> str | None:
    """The type ``block`` names itself (``"web_search_tool_result"``); None: none."""
    name = block.get("type") if isinstance(block, Mapping) else None
    return name if isinstance(name, str) else None


def text(block: Any) -> str:
    """The text of a text block, the reasoning of a thinking block; "" for any other."""
    if isinstance(block, str):
        return block
    if not isinstance(block, Mapping):
        return ""
    value = block.get({BlockKind.TEXT: "text", BlockKind.THINKING: "thinking"}.get(
        kind(block), ""))
    return value if isinstance(value, str) else "" if value is None else str(value)


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def tool_call(block: Any) -> ToolCall:
    """The call a ``tool_use`` (or server tool use) block asks for."""
    block = block if isinstance(block, Mapping) else {}
    return ToolCall(_str(block.get("id")), _str(block.get("name")), block.get("input"))


def tool_result(block: Any) -> ToolResult:
    """The result a ``tool_result`` (or server tool result) block holds."""
    block = block if isinstance(block, Mapping) else {}
    return ToolResult(_str(block.get("tool_use_id")), _str(block.get("name")),
                      block.get("content"), block.get("is_error") is True)


def image(block: Any) -> Image:
    """The source of an image block."""
    source = block.get("source") if isinstance(block, Mapping) else None
    source = source if isinstance(source, Mapping) else {}
    return Image(_str(source.get("type")), _str(source.get("media_type")),
                 _str(source.get("data")), _str(source.get("url")))


def as_blocks(content: Any) -> list[Any]:
    """Content as a list of blocks: a string is one text block, None none, a list its
    items, any other value one block of its own (:attr:`BlockKind.OTHER`)."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": BlockKind.TEXT.value, "text": content}]
    return list(content) if isinstance(content, list) else [content]


# ---------------------------------------------------------------------- turns


def role(turn: Any) -> str | None:
    """Who said the turn: ``user``, ``assistant``, ``system``, ``tool`` ... (None: it
    does not say)."""
    return _str(turn.get("role")) if isinstance(turn, Mapping) else None


def blocks(turn: Any) -> list[Any]:
    """The blocks of a turn (or of a reply)."""
    return as_blocks(turn.get("content")) if isinstance(turn, Mapping) else []


def tool_calls(turn: Any) -> list[ToolCall]:
    """The tool calls a turn asks the agent to run (not those the API runs itself)."""
    return [tool_call(b) for b in blocks(turn) if kind(b) is BlockKind.TOOL_USE]


def tool_results(turn: Any) -> list[ToolResult]:
    """The results of the agent's tools a turn carries."""
    return [tool_result(b) for b in blocks(turn) if kind(b) is BlockKind.TOOL_RESULT]


def text_of(turn: Any) -> str:
    """The text of a turn's text blocks, joined by newlines."""
    return "\n".join(text(b) for b in blocks(turn) if kind(b) is BlockKind.TEXT)


# ---------------------------------------------------------------------- a conversation


def turns(conv: Conversation) -> list[dict[str, Any]]:
    """The request's turns, in order."""
    return conv["messages"]


def system(conv: Conversation) -> list[Any]:
    """The system prompt's blocks (none: the request has none apart from its turns)."""
    return as_blocks(conv["system"])


def reply(conv: Conversation) -> dict[str, Any] | None:
    """The response message as one turn (None: no message)."""
    return conv["reply"]


def settings(conv: Conversation) -> dict[str, Any]:
    """The rest of the request: the model, tools, parameters."""
    return conv["settings"]


def as_request(conv: Conversation) -> dict[str, Any]:
    """The call's request as one Messages-API-shaped document: its settings, its system
    prompt (when it has one) and its turns, as ``messages``. Two calls of any provider
    compare field by field in it (``deja diff``)."""
    out = {**conv["settings"], "messages": conv["messages"]}
    if conv["system"] is not None:
        out["system"] = conv["system"]
    return out


def request_turns(document: Any) -> list[Any]:
    """The turns of a document :func:`as_request` made (none when it is no such
    document)."""
    found = document.get("messages") if isinstance(document, Mapping) else None
    return found if isinstance(found, list) else []


# ---------------------------------------------------------------------- tool-use ids


def _tool_blocks(value: Any) -> Iterator[Mapping[str, Any]]:
    """Every tool call and result block anywhere inside ``value``, in order."""
    if isinstance(value, list):
        for item in value:
            yield from _tool_blocks(item)
    elif isinstance(value, Mapping):
        if kind(value) in (*_CALLS, BlockKind.TOOL_RESULT):
            yield value
        for item in value.values():
            yield from _tool_blocks(item)


def stable_ids(value: Any, ids: dict[str, str]) -> Any:
    """``value`` with its tool-use ids, random in every run, replaced by their order of
    first use (``tool_use#0``, in ``ids``, shared by the steps of a run); so is a
    Responses chain's ``previous_response_id`` (``response#1``)."""
    if isinstance(value, list):
        return [stable_ids(v, ids) for v in value]
    if not isinstance(value, dict):
        return value
    calls = kind(value) in _CALLS
    out = {}
    for key, v in value.items():
        if isinstance(v, str) and (key == "tool_use_id" or (key == "id" and calls)):
            v = ids.setdefault(v, f"tool_use#{len(ids)}")
        elif key == "previous_response_id" and isinstance(v, str):
            v = ids.setdefault(v, f"response#{len(ids)}")
        out[key] = stable_ids(v, ids)
    return out


def tool_names(value: Any) -> dict[str, str]:
    """Tool-use id -> tool name, of every tool call anywhere inside ``value``."""
    calls = [tool_call(b) for b in _tool_blocks(value) if kind(b) is BlockKind.TOOL_USE]
    return {call.id: str(call.name) for call in calls if call.id is not None}


def _unique(seen: dict[str, int], name: str | None) -> str | None:
    """``name``, or ``name#n`` for its n-th use (n > 1) among those ``seen``."""
    if name is None:
        return None
    count = seen[name] = seen.get(name, 0) + 1
    return name if count == 1 else f"{name}#{count}"


def numbered_calls(items: Sequence[Any]) -> list[ToolCall]:
    """The tool calls of the assistant turns among ``items``, each id unique in them: an
    id used again (Gemini's function name, for a call the model gave no id) is
    ``id#2``, ``id#3`` ... in order. :func:`numbered_results` numbers results alike, so
    the n-th result for an id answers the n-th call of it."""
    seen: dict[str, int] = {}
    return [replace(call, id=_unique(seen, call.id)) for turn in items
            if role(turn) == "assistant" for call in tool_calls(turn)]


def numbered_results(items: Sequence[Any]) -> list[tuple[int, ToolResult]]:
    """(index of the turn in ``items``, result) of every tool result the agent sent (in a
    turn that is not the assistant's), ids made unique as :func:`numbered_calls` does."""
    seen: dict[str, int] = {}
    return [(index, replace(result, tool_use_id=_unique(seen, result.tool_use_id)))
            for index, turn in enumerate(items) if role(turn) != "assistant"
            for result in tool_results(turn)]


# ---------------------------------------------------------------------- the turn's end


def reply_unfinished(provider: Provider, message: Any) -> bool:
    """Does the reply ``message`` leave the turn to the agent: it asks for tool calls, or
    stopped for a reason its format says the turn goes on after (Anthropic's
    ``pause_turn``)? Gemini ends a reply that calls functions with ``STOP``: its calls
    say it."""
    if provider.turn_unfinished(provider.stop_reason(message)):
        return True
    return bool(tool_calls(provider.conversation(None, message)["reply"]))


def stop_unfinished(stop_reason: Any) -> bool:
    """Does any registered format say a reply that stopped for ``stop_reason`` leaves
    the turn unfinished (for a reader that knows the reason but not the provider)?"""
    return any(registry.get(name).turn_unfinished(stop_reason) for name in registry.names())


# ---------------------------------------------------------------------- unknown provider


def _tool_count(conv: Conversation) -> int:
    return sum(len(tool_calls(t)) + len(tool_results(t)) for t in conv["messages"])


def reader_of(body: Any) -> Provider | None:
    """The provider whose format reads request ``body``, when the request alone must
    say (None: no registered format finds a conversation in it). A body does not always
    say which API it is in: the Messages API and Chat Completions both send
    ``messages``. Of the providers whose format finds the body's conversation, the one
    that reads the most tool calls and results in it; the first registered on a tie
    (they read it alike)."""
    best: Provider | None = None
    most = -1
    for name in registry.names():
        provider = registry.get(name)
        if provider.history_field(body) is None:
            continue
        count = _tool_count(provider.conversation(body))
        if count > most:
            best, most = provider, count
    return best


# The history fields of the built-in formats: the Messages API's and Chat Completions'
# ``messages``, the Responses API's ``input``, Gemini's ``contents``.
_HISTORY_FIELDS = ("messages", "input", "contents")


def read_history(items: list[Any]) -> tuple[Provider, dict[str, Any]] | None:
    """A history list read without its request: the provider that reads it best as its
    history field's items (see :func:`reader_of`), and the request body it makes."""
    best: tuple[Provider, dict[str, Any]] | None = None
    most = -1
    for field in _HISTORY_FIELDS:
        body = {field: items}
        provider = reader_of(body)
        if provider is None or provider.history_field(body) != field:
            continue
        count = _tool_count(provider.conversation(body))
        if count > most:
            best, most = (provider, body), count
    return best


@dataclass(frozen=True)
class ResultSlot:
    """Where a tool result's content sits in a request body as sent: reading it gives the
    value the agent sent, as it sent it; putting a value there edits the body."""

    holder: dict[str, Any]
    key: str

    def get(self, default: Any = None) -> Any:
        return self.holder.get(self.key, default)

    def put(self, value: Any) -> None:
        self.holder[self.key] = value


@dataclass(frozen=True)
class PlacedResult:
    """A tool result the agent sent (ids made unique, :func:`numbered_results`), the index
    of its turn, and its slot in the body (None: the format does not say where)."""

    turn: int
    result: ToolResult
    slot: ResultSlot | None

    @property
    def sent(self) -> Any:
        """The content as the agent sent it ("" when it sent none; as the conversation
        reads it when the result has no slot)."""
        if self.slot is not None:
            return self.slot.get("")
        return "" if self.result.content is None else self.result.content


def placed_results(provider: Provider, body: Any,
                   conv: Conversation | None = None) -> list[PlacedResult]:
    """The tool results request ``body`` carries, each with its slot: the provider's
    :meth:`~recorder.providers.base.Format.tool_result_slots`, which are those of every
    ``tool_result`` block of its conversation (``conv``, read when not given) in order.
    When the two do not line up (a body the format reads only in part), no result has a
    slot."""
    conv = conv if conv is not None else provider.conversation(body)
    items = conv["messages"]
    places = [(index, role(turn) != "assistant") for index, turn in enumerate(items)
              for b in blocks(turn) if kind(b) is BlockKind.TOOL_RESULT]
    slots = [ResultSlot(holder, key) for holder, key in provider.tool_result_slots(body)]
    if len(slots) != len(places):
        slots = []
    sent = iter(numbered_results(items))  # the agent's, in the same order
    return [PlacedResult(index, next(sent)[1], slots[position] if slots else None)
            for position, (index, by_agent) in enumerate(places) if by_agent]
