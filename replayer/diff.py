"""Compare two runs step by step: where they part, and how each changed step differs.

Steps are those of :mod:`recorder.cassette.rows` and are named by their ``seq``; the headline
counts are step counts (the end line is compared too, but is no step). The bookkeeping
control lines (``fork_edit``, ``resumed``) are left out, since a fork or a resumed run has
them where the other run has none: after a fork step, a fork's seqs run one ahead of its
parent's, and a changed step is named by both (``step 3 (A's 2)``). Each step is reduced
to what it means (request, response message, tool args and result, an MCP step's server,
method and what the server sent before its answer, tokens, cost), leaving
out what differs between any two runs (message and request ids, timestamps, latencies,
signatures), so two recordings of the same behaviour compare equal. Changed fields are
listed as JSON-pointer paths with the value on each side.

The two runs are aligned position by position (:func:`compare`'s default, which
:mod:`replayer.drift` reads step by step), or by what their steps mean
(``align="meaning"``, as ``deja diff`` and the viewer do; :func:`alignment`): the longest
common subsequence of the steps' meanings, then of their kind, name and arguments, then of
their kind and name, and what none matches paired in place. So a step only one run has
is a step "only in" it, and the steps after it stay aligned. :mod:`replayer.diff_many`
compares more than two runs the same way.

A model step is read as a conversation by its provider
(:meth:`recorder.providers.Provider.conversation`): every provider's request is compared
as ``system`` and ``messages`` in the Messages API's shape (an OpenAI tool call is a
``tool_use`` block with parsed arguments, its result a ``tool_result``), its response as
one message, so a change reads ``/request/messages/2/content/0/content`` whatever the API,
and :func:`render` names the message it is in (``[message 2 (tool): tool result of
lookup]``).
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import jsonpatch

from recorder import providers
from recorder.canonical import decode_body
from recorder.capture.exchange import pretty
from recorder.capture.mcp.calls import URL_TRANSPORTS, server_key
from recorder.cassette import Cassette
from recorder.cassette.rows import step_count, step_name
from recorder.cassette.schema import Kind, Line, is_bookkeeping
from recorder.providers import conversation
from recorder.providers.conversation import BlockKind
from recorder.terminal import visible
from recorder.values import decode


def _response_message(obs: Mapping[str, Any]) -> Any:
    response = obs.get("response")
    if not response:
        return None
    data = decode_body(response["body"], response.get("encoding"))
    provider = providers.for_line(obs)
    try:
        message = provider.message(response.get("headers", []), data)
    except ValueError:
        return {"status": response["status"], "text": data.decode("utf-8", "replace")}
    if isinstance(message, dict):
        message = {k: v for k, v in message.items() if k not in provider.volatile_message_keys}
    return {"status": response["status"], "message": message}


def _model_meaning(obs: Mapping[str, Any], request: Any) -> tuple[Any, Any]:
    """A model step's request and response as its provider reads them as a conversation:
    the request's settings with ``system`` and ``messages``, the response's message."""
    provider = providers.for_line(obs)
    response = _response_message(obs)
    message = response.get("message") if isinstance(response, dict) else None
    conv = provider.conversation(request, message)
    semantic = provider.semantic_request(conversation.as_request(conv)
                                         if isinstance(request, dict) else request)
    reply = conversation.reply(conv)
    if isinstance(response, dict) and "message" in response and reply is not None:
        reply = {k: v for k, v in reply.items() if k not in provider.volatile_message_keys}
        response = {**response, "message": reply}
    return semantic, response


def _run_named(value: Any, run: str) -> Any:
    """``value`` with its run's id, which differs between any two runs, as ``RUN``."""
    if isinstance(value, str):
        return value.replace(run, "RUN") if run else value
    if isinstance(value, list):
        return [_run_named(v, run) for v in value]
    if isinstance(value, dict):
        return {k: _run_named(v, run) for k, v in value.items()}
    return value


def _mcp_meaning(part: Any) -> dict[str, Any]:
    """An MCP exchange's part of a step: its server by what a replay matches it by (the
    file names of its command, or its URL's path) with the name and version it gave, the
    method, whether the tool is destructive, and what the server sent before its answer."""
    part = part if isinstance(part, Mapping) else {}
    server = part.get("server") if isinstance(part.get("server"), Mapping) else {}
    key = server_key(server)
    place = {"url": key[1]} if key[0] in URL_TRANSPORTS else {"command": key[1:]}
    return {"server": {"name": server.get("name"), "version": server.get("version"),
                       "transport": key[0], **place},
            "method": part.get("method"), "destructive": bool(part.get("destructive")),
            "notifications": part.get("notifications") or []}


def meaning(cassette: Cassette, obs: Mapping[str, Any]) -> dict[str, Any]:
    """What a step says, without the parts that differ between any two runs."""
    kind = obs.get("kind")
    out: dict[str, Any] = {"kind": kind}
    if kind == Kind.MODEL:
        request, response = _model_meaning(obs, cassette.requests.get(obs["seq"]))
        out.update(model=obs.get("model"), request=request, response=response,
                   usage=obs.get("usage"),
                   cost_usd=obs.get("cost_usd"), error=obs.get("error"))
    elif kind == Kind.HTTP:
        out.update(method=obs.get("method"), url=obs.get("url"),
                   request=(obs.get("request") or {}).get("body"),
                   response=_response_message(obs), error=obs.get("error"))
    elif kind in (Kind.TOOL, Kind.INTENT, Kind.OUTCOME):
        out.update(name=obs.get("name"), args=obs.get("args"),
                   result=decode(obs.get("result")), error=obs.get("error"))
        if "mcp" in obs:  # a call to an MCP server's tool: the server too
            out["mcp"] = _mcp_meaning(obs["mcp"])
    elif kind == Kind.MCP:
        out.update(mcp=_mcp_meaning(obs.get("mcp")), params=obs.get("params"),
                   result=decode(obs.get("result")), error=obs.get("error"))
    elif kind == Kind.EFFECT:
        out.update(name=obs.get("name"), value=obs.get("value"))
    elif kind == Kind.CONTROL:  # a harness message names its run: the same words in any run
        out.update(event=obs.get("event"), detail=_run_named(obs.get("detail"), cassette.run))
    elif kind == Kind.END:
        totals = dict(obs.get("totals") or {})
        totals.pop("duration_s", None)
        totals.pop("replayed", None)  # how the run was made, not what it did
        if isinstance(totals.get("observations"), int):  # counted as compared: no bookkeeping
            totals["observations"] -= sum(1 for o in cassette.observations
                                          if is_bookkeeping(o))
        out.update(status=obs.get("status"), totals=totals)
    return out


@dataclass(frozen=True)
class FieldChange:
    path: str
    op: str
    a: Any
    b: Any


@dataclass(frozen=True)
class StepDiff:
    """One differing step; ``seq`` is B's (A's when B has no such step), ``seq_a`` A's.
    Both are ``seq`` values: the step numbers ``deja show`` prints."""

    seq: int
    kind_a: str | None
    kind_b: str | None
    changes: tuple[FieldChange, ...]
    seq_a: int | None = None
    # the message a change of a model step is in, by change path
    # (``message 2 (tool): tool result of lookup``, ``reply: tool call lookup``)
    messages: Mapping[str, str] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """The step by its seq; an end line is not a step and is named as such."""
        end_a, end_b = self.kind_a in (Kind.END, None), self.kind_b in (Kind.END, None)
        if end_a and end_b:
            return "the end line"
        if self.kind_b == Kind.END:
            return f"A's step {self.seq_a}, B's end line"
        if self.kind_a == Kind.END:
            return f"step {self.seq}, A's end line"
        if self.seq_a is None or self.seq_a == self.seq:
            return f"step {self.seq}"
        return f"step {self.seq} (A's {self.seq_a})"


@dataclass(frozen=True)
class RunDiff:
    """The result of comparing run A with run B.

    ``steps_a``/``steps_b`` are step counts (:func:`recorder.cassette.rows.step_count`);
    ``first_divergence`` is the seq of the first differing step (B's, or A's when B has
    no such step; ``None``: the runs are the same), ``same_prefix`` the number of steps
    before it.
    """

    run_a: str
    run_b: str
    steps_a: int
    steps_b: int
    same_prefix: int
    first_divergence: int | None
    steps: tuple[StepDiff, ...] = field(default_factory=tuple)

    @property
    def same(self) -> bool:
        return self.first_divergence is None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["same"] = self.same
        return out


def _pointer_get(doc: Any, pointer: str) -> Any:
    try:
        return jsonpatch.JsonPointer(pointer).resolve(doc)
    except (jsonpatch.JsonPointerException, KeyError, IndexError, TypeError):
        return None


def aligned(c: Cassette) -> list[Line]:
    """What is compared, in order: the steps without the bookkeeping control lines
    (fork_edit, resumed), then the end line. Two runs are aligned position by position."""
    steps: list[Line] = [o for o in c.observations if not is_bookkeeping(o)]
    return steps + ([c.end] if c.end else [])


_MESSAGE_PATH = re.compile(r"^/request/messages/(\d+)(?:/content/(\d+))?"
                           r"|^/response/message(?:/content/(\d+))?")


def _block_label(block: Any, names: Mapping[str, str]) -> str | None:
    what = conversation.kind(block)
    if what in (BlockKind.TOOL_USE, BlockKind.SERVER_TOOL_USE):
        return f"tool call {conversation.tool_call(block).name}"
    if what is BlockKind.TOOL_RESULT:
        name = names.get(str(conversation.tool_result(block).tool_use_id))
        return f"tool result of {name}" if name else "tool result"
    return conversation.type_name(block)


def _message_labels(changes: tuple[FieldChange, ...], *sides: Any) -> dict[str, str]:
    """The message (and block) each change of a model step is in, from either side."""
    out: dict[str, str] = {}
    for change in changes:
        found = _MESSAGE_PATH.match(change.path)
        if not found:
            continue
        index, block, reply_block = found.groups()
        for side in sides:
            if not isinstance(side, dict) or side.get("kind") != Kind.MODEL:
                continue
            names = conversation.tool_names(side)
            if index is not None:
                messages = conversation.request_turns(side.get("request"))
                if int(index) >= len(messages):
                    continue
                message = messages[int(index)]
                label = f"message {index} ({conversation.role(message)})" \
                    if isinstance(message, dict) else f"message {index}"
            else:
                message = ((side.get("response") or {}).get("message")
                           if isinstance(side.get("response"), dict) else None)
                if not isinstance(message, dict):
                    continue
                label, block = "reply", reply_block
            content = conversation.blocks(message)
            if block is not None and int(block) < len(content):
                what = _block_label(content[int(block)], names)
                label += f": {what}" if what else ""
            out[change.path] = label
            break
    return out


@dataclass(frozen=True)
class Prepared:
    """A run made ready to compare: its aligned lines (:func:`aligned`), what each means
    (:func:`meaning`, tool-use ids numbered in the order the run first uses them) and the
    keys it is aligned by, finest first (:func:`step_keys`)."""

    cassette: Cassette
    steps: list[Line]
    meanings: list[dict[str, Any]]
    keys: tuple[list[Hashable], ...]


def prepare(c: Cassette) -> Prepared:
    steps = aligned(c)
    ids: dict[str, str] = {}
    meanings = [conversation.stable_ids(meaning(c, obs), ids) for obs in steps]
    keys = tuple(list(level) for level in zip(*(step_keys(obs, m) for obs, m in
                                                zip(steps, meanings, strict=True)),
                                              strict=True)) if steps else ([], [], [])
    return Prepared(c, steps, meanings, keys)


def step_keys(obs: Mapping[str, Any], meant: Mapping[str, Any]) -> tuple[Hashable, ...]:
    """What makes two steps "the same step" when runs are aligned, finest first: all it
    means; its kind, name and arguments (a tool's args, an HTTP call's method and URL); its
    kind and name (a tool's name, a model call's model, a control line's event)."""
    kind, name = str(obs.get("kind")), step_name(obs)
    if kind == Kind.END:  # see alignment(): compared where the steps end
        return (Kind.END,) * 3
    args = (meant.get("method"), meant.get("url")) if kind == Kind.HTTP else \
        meant.get("params") if kind == Kind.MCP else meant.get("args")
    return (json.dumps(meant, sort_keys=True, default=str),
            (kind, name, json.dumps(args, sort_keys=True, default=str)), (kind, name))


Pair = tuple[int | None, int | None]
"""Two aligned lines by their index in each run's :func:`aligned` list (None: none)."""

EXACT = 40_000  # steps x steps of a stretch difflib aligns; a longer one: shortest edits
MAX_ALIGNED = 4_000_000  # work the shortest edits of a long stretch may take

Opcode = tuple[str, int, int, int, int]
Opcodes = Sequence[Opcode]
"""How two stretches match, as :meth:`difflib.SequenceMatcher.get_opcodes` says it."""


def align_keys(a: Sequence[Sequence[Hashable]], b: Sequence[Sequence[Hashable]]) -> list[Pair]:
    """Two sequences aligned by their keys (``a[level][i]``), finest level first: the
    steps whose finest keys form a longest common subsequence are matched, each stretch
    between matches is aligned by the next level's keys, and what no level matches is
    paired position by position (a step changed in place lines up with the step it
    replaced; the longer side's rest stands alone). See :func:`_opcodes` for how a level
    is matched."""
    return _align(a, b, 0, (0, len(a[0]) if a else 0), (0, len(b[0]) if b else 0))


def _align(a: Sequence[Sequence[Hashable]], b: Sequence[Sequence[Hashable]], level: int,
           span_a: tuple[int, int], span_b: tuple[int, int]) -> list[Pair]:
    (lo_a, hi_a), (lo_b, hi_b) = span_a, span_b
    head: list[Pair] = []
    tail: list[Pair] = []
    if level < len(a):  # the same start and end: matched at once
        keys_a, keys_b = a[level], b[level]
        while lo_a < hi_a and lo_b < hi_b and keys_a[lo_a] == keys_b[lo_b]:
            head.append((lo_a, lo_b))
            lo_a, lo_b = lo_a + 1, lo_b + 1
        while lo_a < hi_a and lo_b < hi_b and keys_a[hi_a - 1] == keys_b[hi_b - 1]:
            hi_a, hi_b = hi_a - 1, hi_b - 1
            tail.insert(0, (hi_a, hi_b))
    if level == len(a):
        return head + [(lo_a + k if lo_a + k < hi_a else None,
                        lo_b + k if lo_b + k < hi_b else None)
                       for k in range(max(hi_a - lo_a, hi_b - lo_b))] + tail
    for tag, i1, i2, j1, j2 in _opcodes(a[level][lo_a:hi_a], b[level][lo_b:hi_b]):
        if tag == "equal":
            head += [(lo_a + i1 + k, lo_b + j1 + k) for k in range(i2 - i1)]
        else:
            head += _align(a, b, level + 1, (lo_a + i1, lo_a + i2), (lo_b + j1, lo_b + j2))
    return head + tail


def _opcodes(a: Sequence[Hashable], b: Sequence[Hashable]) -> Opcodes:
    """How one level's keys of two stretches match. A short stretch: difflib's
    :class:`~difflib.SequenceMatcher` (its longest matching blocks). A long one, where
    difflib can take minutes when keys repeat: the shortest edit script (Myers' O(ND)
    algorithm, a longest common subsequence) when the two differ in few enough steps to
    find it within :data:`MAX_ALIGNED`; else difflib with its "popular" rule (a key found
    in more than one place in a hundred is no anchor at this level)."""
    if len(a) * len(b) <= EXACT:
        return difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes()
    found = _shortest_edits(a, b, MAX_ALIGNED // (len(a) + len(b)))
    if found is not None:
        return found
    return difflib.SequenceMatcher(None, a, b, autojunk=True).get_opcodes()


def _shortest_edits(a: Sequence[Hashable], b: Sequence[Hashable],
                    most: int) -> Opcodes | None:
    """Myers' shortest edit script of ``a`` into ``b`` as opcodes, or None when it takes
    more than ``most`` edits. ``v[k]``: how far along ``a`` the furthest path on diagonal
    ``k`` (``x - y``) got; each round's ``v`` is kept, to walk the path back."""
    n, m = len(a), len(b)
    v, rounds = {1: 0}, []
    for d in range(min(most, n + m) + 1):
        rounds.append(dict(v))
        for k in range(-d, d + 1, 2):
            x = v[k + 1] if k == -d or (k != d and v[k - 1] < v[k + 1]) else v[k - 1] + 1
            y = x - k
            while x < n and y < m and a[x] == b[y]:
                x, y = x + 1, y + 1
            v[k] = x
            if x >= n and y >= m:
                return _as_opcodes(_walked_back(rounds, n, m), n, m)
    return None


def _walked_back(rounds: list[dict[int, int]], n: int, m: int) -> list[tuple[int, int]]:
    """The matched pairs of the shortest path that :func:`_shortest_edits` found."""
    matched: list[tuple[int, int]] = []
    x, y = n, m
    for d in range(len(rounds) - 1, -1, -1):
        v, k = rounds[d], x - y
        before = k + 1 if k == -d or (k != d and v[k - 1] < v[k + 1]) else k - 1
        start_x = v[before]
        while x > start_x and y > start_x - before:
            x, y = x - 1, y - 1
            matched.append((x, y))
        x, y = start_x, start_x - before
    return matched[::-1]


def _as_opcodes(matched: list[tuple[int, int]], n: int, m: int) -> Opcodes:
    """Matched pairs (in order) as opcodes: runs of them ``equal``, what lies between
    ``replace`` (one side may be empty)."""
    out: list[Opcode] = []
    i = j = 0
    for x, y in [*matched, (n, m)]:
        if (x, y) != (i, j):
            out.append(("replace", i, x, j, y))
        if (x, y) != (n, m):
            if out and out[-1][0] == "equal" and out[-1][2] == x and out[-1][4] == y:
                out[-1] = ("equal", out[-1][1], x + 1, out[-1][3], y + 1)
            else:
                out.append(("equal", x, x + 1, y, y + 1))
        i, j = x + 1, y + 1
    return out


def alignment(a: Prepared, b: Prepared) -> list[Pair]:
    """Run ``b`` aligned with run ``a`` by what their steps mean (:func:`align_keys`), so
    that a step one run has and the other has not leaves the steps after it aligned. The
    end lines are not aligned by key: each is compared where its run's steps end, paired
    in place with what follows the last step both runs have (so a run that stopped early
    shows its end line where the other went on)."""
    count_a = len(a.steps) - (1 if a.cassette.end else 0)
    count_b = len(b.steps) - (1 if b.cassette.end else 0)
    pairs = align_keys([level[:count_a] for level in a.keys],
                       [level[:count_b] for level in b.keys])
    kept = len(pairs)
    while kept and None in pairs[kept - 1]:  # after the last step both runs have
        kept -= 1
    rest_a = [i for i, _ in pairs[kept:] if i is not None] + [count_a] * bool(a.cassette.end)
    rest_b = [j for _, j in pairs[kept:] if j is not None] + [count_b] * bool(b.cassette.end)
    return pairs[:kept] + [(rest_a[n] if n < len(rest_a) else None,
                            rest_b[n] if n < len(rest_b) else None)
                           for n in range(max(len(rest_a), len(rest_b)))]


def step_diff(a: Prepared, b: Prepared, pair: Pair) -> StepDiff | None:
    """How the lines of ``pair`` differ (None: they mean the same)."""
    i, j = pair
    ma = a.meanings[i] if i is not None else None
    mb = b.meanings[j] if j is not None else None
    if ma == mb:
        return None
    changes: tuple[FieldChange, ...]
    if ma is None or mb is None:
        changes = (FieldChange("", "missing" if mb is None else "added", ma, mb),)
    elif ma["kind"] != mb["kind"]:
        changes = (FieldChange("/kind", "replace", ma["kind"], mb["kind"]),)
    else:
        patch = jsonpatch.make_patch(ma, mb).patch
        changes = tuple(FieldChange(op["path"], op["op"], _pointer_get(ma, op["path"]),
                                    _pointer_get(mb, op["path"])) for op in patch)
    seq_a = a.steps[i]["seq"] if i is not None else None
    seq = b.steps[j]["seq"] if j is not None else seq_a
    assert seq is not None  # a pair names a line of one run at least
    return StepDiff(seq, (ma or {}).get("kind"), (mb or {}).get("kind"), changes, seq_a,
                    _message_labels(changes, ma, mb))


def run_diff(a: Prepared, b: Prepared, pairs: Sequence[Pair],
             steps: Sequence[StepDiff | None] | None = None) -> RunDiff:
    """The :class:`RunDiff` of two prepared runs aligned as ``pairs`` say; ``steps``: the
    :func:`step_diff` of each pair, when it is known already."""
    diffs: list[StepDiff] = []
    first: int | None = None
    position = 0
    for row, pair in enumerate(pairs):
        step = step_diff(a, b, pair) if steps is None else steps[row]
        if step is None:
            continue
        if first is None:
            first, position = step.seq, row
        diffs.append(step)
    count_a, count_b = step_count(a.cassette), step_count(b.cassette)
    # the steps before the first divergence, as aligned (bookkeeping lines left out)
    same_prefix = position if first is not None else min(count_a, count_b)
    return RunDiff(a.cassette.run, b.cassette.run, count_a, count_b, same_prefix, first,
                   tuple(diffs))


def compare(a: Cassette, b: Cassette, *, align: str = "position") -> RunDiff:
    """Run ``a`` compared with run ``b`` step by step. ``align="position"``: the n-th step
    of one with the n-th of the other (bookkeeping lines left out); ``align="meaning"``:
    aligned by what the steps mean (:func:`alignment`), so that one inserted step does
    not set every step after it against another."""
    pa, pb = prepare(a), prepare(b)
    if align == "meaning":
        pairs = alignment(pa, pb)
    elif align == "position":
        n, m = len(pa.steps), len(pb.steps)
        pairs = [(i if i < n else None, i if i < m else None) for i in range(max(n, m))]
    else:
        raise ValueError(f"align must be 'position' or 'meaning', not {align!r}")
    return run_diff(pa, pb, pairs)


def _pair(a: Any, b: Any, width: int = 70) -> tuple[str, str]:
    """Both sides of a change, long strings cut to show where they differ."""
    ta, tb = (json.dumps(v, ensure_ascii=False, default=str) for v in (a, b))
    if len(ta) <= width and len(tb) <= width:
        return ta, tb
    start = 0
    while start < min(len(ta), len(tb)) and ta[start] == tb[start]:
        start += 1
    start = max(0, start - 15)

    def cut(text: str) -> str:
        return (("…" if start else "") + text[start:start + width]
                + ("…" if len(text) > start + width else ""))

    return cut(ta), cut(tb)


def render(diff: RunDiff, *, max_changes: int = 12) -> str:
    lines = [f"A {diff.run_a} ({diff.steps_a} steps)  B {diff.run_b} ({diff.steps_b} steps)"]
    if diff.same:
        lines.append("same: every step means the same in both runs")
        return visible("\n".join(lines))
    first = diff.first_divergence or 0
    extra = first - diff.same_prefix  # bookkeeping lines among them (fork_edit, resumed)
    counted = f"{diff.same_prefix} steps" + (
        f" and {extra} bookkeeping line{'s' if extra > 1 else ''}" if extra > 0 else "")
    if first == 1:
        lines.append("step 0: identical")
    elif first > 1:
        lines.append(f"steps 0-{first - 1}: identical ({counted})")
    lines.append(f"first divergence: {diff.steps[0].label}")
    only = [s for s in diff.steps if s.changes and s.changes[0].op in ("missing", "added")]
    for step in diff.steps:
        if step in only:
            continue
        kinds = step.kind_a if step.kind_a == step.kind_b else f"{step.kind_a} -> {step.kind_b}"
        lines.append(f"{step.label} ({kinds}):")
        for change in step.changes[:max_changes]:
            a, b = _pair(change.a, change.b)
            a = "(absent)" if change.op == "add" else a
            b = "(absent)" if change.op == "remove" else b
            where = step.messages.get(change.path)
            lines.append(f"  {change.path or '/'}: {a} -> {b}" + (f"  [{where}]" if where else ""))
        if len(step.changes) > max_changes:
            lines.append(f"  … {len(step.changes) - max_changes} more changes")
    for side, op in (("A", "missing"), ("B", "added")):
        steps = [s for s in only if s.changes[0].op == op]
        ends = [s for s in steps if (s.kind_a or s.kind_b) == Kind.END]
        steps = [s for s in steps if s not in ends]
        if steps:
            lines.append(f"only in {side}: {len(steps)} step(s), "
                         + ", ".join(f"{s.seq_a if op == 'missing' else s.seq} "
                                     f"{s.kind_a or s.kind_b}" for s in steps[:12])
                         + (" …" if len(steps) > 12 else "")
                         + (", then its end line" if ends else ""))
        elif ends:
            lines.append(f"only in {side}: its end line")
    return visible("\n".join(lines))


def unified(expected: Any, actual: Any, *, expected_name: str = "recorded",
            actual_name: str = "replayed", context: int = 3) -> str:
    """A readable unified diff of two JSON-like values."""
    a = pretty(expected).splitlines()
    b = pretty(actual).splitlines()
    return "\n".join(difflib.unified_diff(a, b, expected_name, actual_name, lineterm="",
                                          n=context))
