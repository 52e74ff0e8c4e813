"""The Streamlit pieces the pages are built from: an opened step (its conversation, tool
call, control line, raw JSON), the fork editor and the forks started from a run, a run's
lineage and its live panel with the cancel button.

Called by the page script (:mod:`viewer.app`); every question goes to :mod:`viewer.queries`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import streamlit as st
from streamlit.errors import StreamlitAPIException

from recorder.cassette.schema import Kind
from recorder.errors import DejaError
from recorder.providers.conversation import BlockKind
from viewer import queries
from viewer.content import Block, image_type
from viewer.index import RunIndex
from viewer.queries import StepDetail
from viewer.safe import md

THUMBNAIL_WIDTH = 160
FILLED = "timeline_filled"  # session state: the run whose whole timeline the page has drawn


def go(**params: Any) -> None:
    """Callback: show another page (the URL holds the page).

    The whole script reruns: a button inside a fragment (the runs table, a run's
    refreshing body) would otherwise rerun only that fragment, and the URL would change
    with the old page still shown. A run's page opened anew draws a long timeline's first
    screen first again (:class:`viewer.app.Timeline`).
    """
    st.session_state.pop(FILLED, None)
    for name in list(st.query_params):
        try:
            del st.query_params[name]
        except StreamlitAPIException:  # bound to a widget (the search box): it stays, so
            continue                   # "All runs" comes back to the same search
    st.query_params.update({k: str(v) for k, v in params.items() if v is not None})
    st.rerun()


def run_params(row: dict[str, Any]) -> dict[str, Any]:
    """The URL of a run's page: its id, and its file (what tells two copies apart); for a
    run opened from the runs database, its id there (``submitted``), which names its
    cassette; for a run of another folder, the run of the viewed folder whose fork tree
    it is in (``via``, :mod:`viewer.lineage`)."""
    if row.get("submitted"):
        return {"submitted": row["submitted"]}
    params = {"run": row.get("run"),
              "file": Path(row["path"]).name if row.get("path") else None}
    return {**params, "via": row["via"]} if row.get("via") else params


def diff_params(*rows: dict[str, Any]) -> dict[str, Any]:
    """The URL of the diff of run rows ``rows`` (tagged ``a``, ``b``, ... in order; the
    first is the base)."""
    params: dict[str, Any] = {}
    for tag, row in zip("abcdefghijklmnopqrstuvwxyz", rows, strict=False):
        side = run_params(row)
        if "submitted" in side:
            params[f"{tag}_submitted"] = side["submitted"]
        else:
            params.update({tag: side["run"], f"{tag}_file": side["file"]})
            if side.get("via"):
                params[f"{tag}_via"] = side["via"]
    return params


def money(value: Any) -> str:
    return "-" if value is None else f"${value:,.6f}"


def _short(value: Any, width: int = 300) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False,
                                                           default=str)
    return text if len(text) <= width else text[:width - 1] + "…"


def image(block: Block) -> None:
    """An image from its bytes (PNG, JPEG, GIF or WebP by their signature); a remote one
    by its URL, as text: the page never fetches what a run names."""
    data = block.get("data")
    if isinstance(data, (bytes, bytearray)) and image_type(bytes(data)):
        st.image(bytes(data), width=THUMBNAIL_WIDTH,
                 caption=md("{}, {:,} bytes", image_type(bytes(data)), len(data)))
    elif data is not None:
        st.warning(md(":material/image: {:,} bytes that are not a PNG, JPEG, GIF or WebP "
                      "image (not shown)", len(data)))
    elif block.get("url"):
        st.markdown(md(":material/image: image at {:code} (not fetched)", block["url"]))
    else:
        st.warning(md(":material/broken_image: {}", block.get("error", "image")))


def blocks(items: list[Block], *, result: bool = False) -> None:
    """Message content blocks (laid out by :func:`viewer.content.blocks`, each of a
    :class:`~recorder.providers.conversation.BlockKind`): a provider's tool calls and
    results, Gemini's function calls and responses among them, alike; inside a tool
    result, text is shown verbatim."""
    for block in items:
        kind = block["type"]
        if kind == BlockKind.TEXT:
            if result:
                st.code(block["text"], language=None, wrap_lines=True)
            else:
                st.text(block["text"])
        elif kind == BlockKind.THINKING:
            with st.expander(":material/psychology: Thinking", expanded=False):
                st.text(block["text"])
        elif kind == BlockKind.TOOL_USE:
            st.markdown(md(":material/build: **tool call** {:code} · id {:code}", block.get("name"),
                           block.get("id")))
            st.json(block.get("input"), expanded=True)
        elif kind == BlockKind.TOOL_RESULT:
            st.markdown("↩ **tool result**"
                        + (md(" of {:code}", block["name"]) if block.get("name") else "")
                        + md(" for {:code}", block.get("tool_use_id"))
                        + (" · :material/error: **error**" if block.get("is_error") else ""))
            blocks(block.get("blocks") or [], result=True)
        elif kind == BlockKind.IMAGE:
            image(block)
        else:
            st.caption(md("{} block", block.get("label")))
            st.json(block.get("raw"), expanded=False)


def _avatar(role: str) -> str | None:
    return {"user": None, "assistant": None, "system": ":material/settings:",
            "developer": ":material/settings:", "tool": ":material/build:"}.get(
        role, ":material/chat:")


def message(msg: dict[str, Any]) -> None:
    with st.chat_message(msg["role"], avatar=_avatar(msg["role"])):
        blocks(msg["blocks"])


def conversation(conv: dict[str, Any]) -> None:
    """A model call: system prompt, earlier messages folded, new messages, the response."""
    if conv["system"]:
        with st.chat_message("system", avatar=":material/settings:"):
            blocks(conv["system"])
    earlier = [m for m in conv["turns"] if not m["new"]]
    if earlier:
        with st.expander(md("Earlier messages of the conversation ({})", len(earlier))):
            for msg in earlier:
                message(msg)
    for msg in conv["turns"]:
        if msg["new"]:
            message(msg)
    response = conv["response"]
    if response is None:
        err = conv.get("error") or {}
        st.error(md("No response: {}: {}", err.get("type"), err.get("message")))
        return
    with st.chat_message("assistant"):
        blocks(response["blocks"])
        if response.get("error"):
            st.error(md("{}: {}", response["error"].get("type"),
                        response["error"].get("message")))
        usage = response.get("usage") or {}
        st.caption(md("{}", " · ".join(str(p) for p in (
            f"HTTP {response.get('status')}", "streamed" if response.get("streamed") else None,
            f"stop: {response.get('stop_reason')}",
            f"tokens in/out: {usage.get('input_tokens')}/{usage.get('output_tokens')}"
            if usage else None) if p)))


def tool(detail: StepDetail) -> None:
    call = detail.tool or {}
    with st.chat_message("tool", avatar=":material/build:"):
        st.markdown(md("**{}** {:code}", detail.kind, call.get("name")))
        if call.get("args") is not None:
            st.caption("arguments")
            st.json(call["args"], expanded=True)
        if "error" in call:
            err = call["error"] or {}
            st.error(md("{}: {}", err.get("type"), err.get("message")))
        elif "result" in call:
            st.caption("value" if detail.kind == Kind.EFFECT else "result")
            if isinstance(call["result"], str):
                st.code(call["result"], language=None, wrap_lines=True)
            else:
                st.json(call["result"], expanded=True)
        for img in call.get("images") or []:
            image(img)


_SERVER_FIELDS = ("name", "version", "transport", "command", "url")


def mcp(info: dict[str, Any]) -> None:
    """An MCP step's own part: the server, the method and tool as a small table, then
    what the server sent before its answer, in order, each notification or request of the
    client with its params, and the client's answer to a request. All of it text: a grid's
    cells and JSON are never read as markup."""
    server = info["server"]
    rows = [{"": key, "value": " ".join(map(str, server[key])) if key == "command"
             and isinstance(server[key], list) else _text(server[key])}
            for key in _SERVER_FIELDS if key in server]
    rows += [{"": "method", "value": _text(info["method"])}]
    if info["tool"]:
        rows += [{"": "tool", "value": _text(info["tool"])},
                 {"": "destructive", "value": "yes" if info["destructive"] else "no"}]
    st.caption("MCP server and call")
    st.dataframe(rows, hide_index=True, key="mcp_server", column_config={
        "": st.column_config.TextColumn(width="small"),
        "value": st.column_config.TextColumn(width="large")})
    exchange = info["exchange"]
    if not exchange:
        return
    with st.expander(md("What the server sent before its answer ({})", len(exchange)),
                     expanded=True):
        for n, entry in enumerate(exchange, 1):
            asked = entry["kind"] == "request"
            st.markdown(md("**{}** · {} {:code}", n, "request of the client" if asked
                           else "notification", entry["method"]))
            st.json(entry.get("params"), expanded=True)
            if "error" in entry:
                st.caption("the client's answer: an error")
                st.json(entry["error"], expanded=True)
            elif "result" in entry:
                st.caption("the client's answer")
                st.json(entry["result"], expanded=True)


def control(detail: StepDetail) -> None:
    info = detail.control or {}
    st.warning(md(":material/flag: control line: **{}**", info.get("event")))
    st.json(info.get("detail"), expanded=True)


def raw(detail: StepDetail) -> None:
    with st.expander("Raw observation (JSON)"):
        st.json(detail.observation, expanded=False)
    if detail.request is not None:
        with st.expander("Raw request (JSON)"):
            st.json(detail.request, expanded=False)
    if detail.response is not None:
        with st.expander("Raw response"):
            st.caption(md("HTTP {}", detail.response.get("status")))
            body = detail.response.get("body")
            if isinstance(body, str):
                st.code(body, language=None, wrap_lines=True)
            else:
                st.json(body, expanded=False)
            st.json({"headers": detail.response.get("headers")}, expanded=False)


def step(detail: StepDetail) -> None:
    """Everything about one opened step, except the fork editor."""
    marks = [f"status {detail.status}"]
    if detail.edited:
        marks.append("✎ edited by a fork")
    if detail.within:
        marks.append(f"↳ made inside tool call {detail.within}")
    st.caption(md("{}", " · ".join(marks + detail.notes)))
    if detail.kind == Kind.CONTROL:
        control(detail)
    elif detail.conversation is not None:
        conversation(detail.conversation)
    elif detail.tool is not None:
        tool(detail)
    if detail.mcp is not None:
        mcp(detail.mcp)
    if detail.kind == Kind.END:
        st.json(detail.observation, expanded=True)
    raw(detail)


# What a side of a change shows when the field is not there.
_NOT_THERE = {"add": ("(not there)", None), "added": ("(no such step)", None),
              "remove": (None, "(removed)"), "missing": (None, "(no such step)")}
CONTEXT = 24  # characters kept each side of what changed in a long value


def changes_table(changes: Any) -> list[dict[str, str]]:
    """One row per changed field: both sides as text, a long value cut around what
    changed (the shared start and end left out), a side without the field saying so."""
    rows = []
    for c in changes:
        a, b = _text(c.a), _text(c.b)
        if c.op not in _NOT_THERE and max(len(a), len(b)) > 2 * CONTEXT + 12:
            a, b = _around_change(a, b)
        gone_a, gone_b = _NOT_THERE.get(c.op, (None, None))
        rows.append({"field": c.path or "/", "change": c.op, "A": gone_a or _short(a),
                     "B": gone_b or _short(b)})
    return rows


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False,
                                                           default=str)


def _around_change(a: str, b: str) -> tuple[str, str]:
    """``a`` and ``b`` cut to what differs, with CONTEXT characters each side."""
    start = 0
    while start < min(len(a), len(b)) and a[start] == b[start]:
        start += 1
    end = 0
    while end < min(len(a), len(b)) - start and a[-1 - end] == b[-1 - end]:
        end += 1
    lo = max(0, start - CONTEXT)

    def cut(text: str) -> str:
        hi = min(len(text), len(text) - end + CONTEXT)
        return ("…" if lo else "") + text[lo:hi] + ("…" if hi < len(text) else "")

    return cut(a), cut(b)


# ---------------------------------------------------------------------- lineage, live


def lineage_panel(index: RunIndex, header: dict[str, Any]) -> None:
    """The run's parent and the forks of it in its folder. A run opened from the runs
    database lies outside the viewed folder, and so do they: named, not opened."""
    info = queries.lineage(index, header["path"]) or {}
    here = not header.get("submitted") and not header.get("via")
    parent = info.get("parent")
    if parent:
        reachable = parent["indexed"] and here
        where = "" if reachable else " (not in this directory)"
        st.info(md("Forked from run **{}** at step {}{}.", parent["run"], parent["step"], where))
        left, right = st.columns(2)
        left.button(md("Open parent {}", parent["run"]), key="open_parent", on_click=go,
                    kwargs=run_params(parent), disabled=not reachable)
        right.button("Diff against parent", key="diff_parent", on_click=go,
                     kwargs=diff_params(parent, header) if reachable else {},
                     disabled=not reachable)
    children = info.get("children") or []
    if children:
        st.markdown(md("**Forks of this run** ({})", len(children)))
        for child in children:
            left, right = st.columns([3, 1])
            left.button(md("{} · {} · forked at step {} · {}", child["name"], child["file"],
                           child["step"], child["status"]), key=f"child:{child['path']}",
                        on_click=go, kwargs=run_params(child), disabled=not here)
            right.button("Diff", key=f"childdiff:{child['path']}", on_click=go,
                         kwargs=diff_params(header, child), disabled=not here)


def _cancel(run: str) -> None:
    try:
        queries.cancel(run)
    except DejaError as exc:
        st.session_state["cancel_error"] = str(exc)


def live_panel(header: dict[str, Any], status: dict[str, Any]) -> None:
    record = status["record"]
    if not status["running"]:
        if status["alive"] is False:
            st.warning(md("The status record says running, but process {} is gone: the run "
                          "crashed. Continue it with {:code}.", record.get("pid"),
                          f"deja resume {header['path']}"))
        return
    st.subheader("● Live")
    st.info(md("Running: {} (updated {})", record.get("step"), record.get("updated")))
    cols = st.columns(4)
    limit = record.get("turn_limit")
    cols[0].metric("Turn", md("{}", record.get("turn")) + (md(" / {}", limit) if limit else ""))
    cols[1].metric("Elapsed", f"{record.get('elapsed_s') or 0:.1f}s")
    cols[2].metric("Tokens", f"{record.get('tokens') or 0:,}")
    cols[3].metric("Spend", money(record.get("spend_usd")))
    with st.expander("Progress record"):
        st.json(record, expanded=True)
    if status["cancel"] is not None:
        st.warning(md("Cancel requested ({}); the run stops at its next boundary.",
                      status["cancel"].get("reason") or "no reason"))
        return
    confirm = st.checkbox("Yes, stop this run at its next boundary", key="cancel_confirm")
    st.button("Cancel run", key="cancel_btn", type="primary", disabled=not confirm,
              on_click=_cancel, args=(header["run"],))
    if "cancel_error" in st.session_state:
        st.error(md("{}", st.session_state.pop("cancel_error")))


# ---------------------------------------------------------------------- fork


def _kept(store: str, key: str, widget: str, default: str) -> None:
    """Seed the widget ``widget`` from what was last typed into it (kept under
    ``store[key]``, which Streamlit's widget bookkeeping never clears), else ``default``.

    A fork reruns the page many times while it runs; the edit, and the live target, must
    outlast all of it, so that the user can try a variation when it ends."""
    kept = st.session_state.setdefault(store, {})
    value = kept.get(key) or default
    if not st.session_state.get(widget):  # gone, or emptied by a redraw: put it back
        st.session_state[widget] = value


def _keep(store: str, key: str, widget: str) -> None:
    """Callback: remember what the user typed (an emptied box keeps the last value)."""
    value = st.session_state.get(widget)
    if value:
        st.session_state.setdefault(store, {})[key] = value


def fork_editor(header: dict[str, Any], detail: queries.StepDetail, *,
                out_dir: Path | None = None) -> None:
    """The editor of a step's recorded value and the Fork button; the fork is written to
    ``out_dir`` (next to the run by default)."""
    st.subheader(md("Fork at step {}", detail.seq))
    st.caption("Edit what this step returned and run the agent again: the steps before it "
               "replay from this run, this step serves your edit, the rest goes live. The "
               "edit is the whole document, or an RFC 6902 patch (a JSON list).")
    if out_dir is not None:
        st.caption(md("The fork is written to {:code}, the folder this viewer shows.",
                      out_dir))
    key = f"{header['path']}:{detail.seq}"
    widget = f"doc:{key}"
    try:
        original = queries.document_text(queries.fork_document(header["path"], detail.seq))
    except DejaError as exc:
        st.error(md("{}", exc))
        return
    _kept("fork_edits", key, widget, original)
    text = st.text_area("Edited document (JSON)", key=widget, height=260, on_change=_keep,
                        args=("fork_edits", key, widget))
    st.button("Reset", key="fork_reset", on_click=_reset, args=(key, widget, original))
    target = f"live_url:{header['path']}"
    _kept("live_urls", header["path"], target, os.environ.get("ANTHROPIC_BASE_URL")
          or queries.recorded_base_url(header["path"]) or "")
    live_url = st.text_input("Live target: the model API the steps after the fork call "
                             "(ANTHROPIC_BASE_URL; by default where this run went)",
                             key=target, on_change=_keep,
                             args=("live_urls", header["path"], target))
    check_key = (header["path"], detail.seq, text)
    cache = st.session_state.setdefault("edit_checks", {})
    if check_key not in cache:
        cache[check_key] = queries.validate_edit(header["path"], detail.seq, text or "")
    error = cache[check_key]
    if error:
        st.error(md("{}", error))
    elif text == original:
        st.info("The document is unchanged: a fork would serve the recorded value.")
    else:
        st.success("The edit is valid.")
    try:  # a side effect runs for real only if ticked here (deja fork --live-tool)
        live_tools = [name for name in queries.side_effect_tools(header["path"], detail.seq)
                      if st.checkbox(md("Run {} live, for real", name),
                                     key=f"live_tool:{header['path']}:{detail.seq}:{name}",
                                     help="Unticked, the fork serves this side-effecting "
                                          "tool its recorded answer to the same arguments, "
                                          "or refuses it (the agent sees ToolRefused).")]
        warnings = queries.fork_warnings(header["path"], detail.seq, live_tools)
    except DejaError:
        live_tools, warnings = [], []
    for warning in warnings:  # before the button: what the live part may do for real
        st.warning(md("Before you fork: {}.", warning.rstrip(".")))
    if st.button("Fork", key="fork_btn", type="primary", disabled=bool(error)):
        try:
            launched = queries.launch_fork(header["path"], detail.seq, text,
                                           live_url=live_url or None, out_dir=out_dir,
                                           live_tools=live_tools)
        except (DejaError, OSError) as exc:
            st.error(md("The fork did not start: {}", exc))
            return
        st.session_state.setdefault("forks", []).append(launched)
        st.rerun()


def _reset(key: str, widget: str, original: str) -> None:
    st.session_state.setdefault("fork_edits", {})[key] = original
    st.session_state[widget] = original


def forks_panel(header: dict[str, Any]) -> None:
    """The forks started from this run in this session, with their progress."""
    mine = [f for f in st.session_state.get("forks", []) if str(f.parent) == header["path"]]
    for launched in reversed(mine):
        state = queries.fork_state(launched)
        name = state["run"] or launched.path.name
        if state["running"]:
            progress = state["progress"] or {}
            st.info(md("⏳ Fork of step {} running: {} · {}", launched.seq, name,
                       progress.get("step", "starting")))
            continue
        if state["reason"] is None:
            st.success(md(":material/check_circle: Fork of step {} finished: run {}",
                          launched.seq, name))
        else:
            st.error(md("Fork of step {} failed: {}", launched.seq, state["reason"]))
            with st.expander(md("Full log (exit status {})", state["returncode"])):
                st.code(state["log"] or "(no output)", language=None, wrap_lines=True)
        if state["exists"] and state["run"]:
            left, right = st.columns(2)
            fork = {"run": state["run"], "path": str(launched.path)}
            left.button(md("Open fork {}", name), key=f"open_fork:{launched.path}", on_click=go,
                        kwargs=run_params(fork))
            right.button("Diff fork against parent", key=f"diff_fork:{launched.path}",
                         on_click=go, kwargs=diff_params(header, fork))
