"""One step of a cassette, opened: what it says, laid out for reading, and a fork of the
run that edits it.

A step's payload is read from its cassette only when it is opened; loaded cassettes are
cached by path, size and modification time. A fork is checked by ``plan_fork`` (a dry
run that writes nothing) and launched as a ``deja fork`` process. No streamlit here: the
page lays out what these return, and tests read it.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import urlsplit

from recorder import providers
from recorder.cassette import Cassette, load
from recorder.cassette.keys import load_keyring
from recorder.cassette.reader import peek_header
from recorder.cassette.rows import step_name, step_status
from recorder.cassette.schema import Kind, Observation
from recorder.errors import DejaError, EditError, NoSuchStep
from recorder.harness.progress import read_status
from replayer import edit
from replayer.fork import plan_fork, side_effect_warning, side_effects_after
from replayer.tool_policy import ToolPolicy
from viewer import content

# ---------------------------------------------------------------------- cassettes


_CACHE_SIZE = 8
_cache: OrderedDict[str, tuple[tuple[int, int], Cassette]] = OrderedDict()
_cache_lock = threading.Lock()


def load_cassette(path: str | Path) -> Cassette:
    """The cassette at ``path``, verified when the key is here; cached by size and mtime."""
    path = Path(path)
    stat = path.stat()
    key, stamp = str(path.resolve()), (stat.st_size, stat.st_mtime_ns)
    with _cache_lock:
        hit = _cache.get(key)
        if hit is not None and hit[0] == stamp:
            _cache.move_to_end(key)
            return hit[1]
    loaded = load(path, keyring=load_keyring(create=False), allow_torn=True)
    with _cache_lock:
        _cache[key] = (stamp, loaded)
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return loaded


def _observation(cassette: Cassette, seq: int) -> Observation:
    if not 0 <= seq < len(cassette.observations):
        raise NoSuchStep(f"{cassette.path}: no step {seq}; the run has steps "
                         f"0-{len(cassette.observations) - 1}")
    return cassette.observations[seq]


def editable(obs: Mapping[str, Any]) -> bool:
    """Can a fork edit this step? (an editable kind, not inside a tool, with a response)"""
    if obs.get("kind") not in edit.EDITABLE or "within" in obs:
        return False
    return obs["kind"] not in (Kind.MODEL, Kind.HTTP) or "response" in obs


@dataclass
class StepDetail:
    """One opened step: its observation and what it says, laid out for reading."""

    path: str
    run: str
    seq: int
    kind: str
    name: str
    status: str
    observation: dict[str, Any]
    request: Any = None
    response: dict[str, Any] | None = None
    conversation: dict[str, Any] | None = None
    tool: dict[str, Any] | None = None
    control: dict[str, Any] | None = None
    mcp: dict[str, Any] | None = None  # an MCP step's server, method and exchange
    editable: bool = False
    edited: bool = False
    within: str | None = None
    truncated: bool = False
    notes: list[str] = field(default_factory=list)


def _raw_response(obs: Mapping[str, Any], clip: content.Clip) -> dict[str, Any] | None:
    response = obs.get("response")
    if not response:
        return None
    text = content.body_text(response)
    body: Any
    if text is None:
        body = f"<{len(response.get('body', '')) * 3 // 4:,} bytes of binary body>"
    elif content.is_streamed(obs):
        body = clip.text(text)
    else:
        try:
            body = clip.value(json.loads(text))
        except ValueError:
            body = clip.text(text)
    return {"status": response.get("status"), "headers": response.get("headers"),
            "body": body}


def _earlier_input(cassette: Cassette, seq: int, request: Any) -> int | None:
    """How many of a request's conversation items an earlier call of the run sent too,
    when its line does not say (a request stored whole: the first of a conversation, an
    edited history, or a format stored whole before it was delta-encoded): the longest
    earlier model step's conversation this one begins with. None when the stored delta
    says it (its ``keep``) or the request has no conversation."""
    stored = cassette.observations[seq].get("request")
    field = providers.history_field(request)
    if (isinstance(stored, dict) and "base" in stored) or field is None:
        return None
    items = request[field]
    for earlier in range(seq - 1, -1, -1):
        if cassette.observations[earlier].get("kind") != Kind.MODEL:
            continue
        before = cassette.requests.get(earlier)
        shared = before.get(field) if isinstance(before, dict) else None
        if isinstance(shared, list) and 0 < len(shared) <= len(items) \
                and items[:len(shared)] == shared:
            return len(shared)
    return 0


def step_detail(path: str | Path, seq: int, *, full: bool = False,
                limit: int = content.LIMIT) -> StepDetail:
    """Step ``seq`` of the cassette at ``path``: the observation, the full request of a
    model step, and its conversation (or tool call, or control decision); an MCP step's
    server, method and what its server sent before the answer (``mcp``, and in words
    among the ``notes``).

    Payloads longer than ``limit`` characters are cut unless ``full``; ``truncated``
    says whether anything was. Images are decoded bytes; base64 never appears as text.
    """
    cassette = load_cassette(path)
    obs: Mapping[str, Any] = _observation(cassette, seq)  # read by field, whatever its kind
    clip = content.Clip(None if full else limit)
    kind = str(obs.get("kind"))
    detail = StepDetail(path=str(path), run=cassette.run, seq=seq, kind=kind,
                        name=step_name(obs), status=step_status(obs),
                        observation=clip.value(obs), editable=editable(obs),
                        edited=bool(obs.get("edited")), within=obs.get("within"))
    if kind == Kind.MODEL:
        request = cassette.requests.get(seq)
        detail.request = clip.value(request)
        detail.response = _raw_response(obs, clip)
        detail.conversation = content.conversation(request, obs, clip,
                                                   _earlier_input(cassette, seq, request))
    elif kind == Kind.HTTP:
        detail.request = clip.value((obs.get("request") or {}).get("body"))
        detail.response = _raw_response(obs, clip)
    elif kind in (Kind.TOOL, Kind.INTENT, Kind.OUTCOME, Kind.MCP):
        detail.tool = content.tool_call(obs, clip)
        detail.mcp = content.mcp_exchange(obs, clip)
        if detail.mcp is not None:
            detail.notes.extend(content.mcp_notes(detail.mcp))
    elif kind == Kind.CONTROL:
        detail.control = {"event": obs.get("event"), "detail": clip.value(obs.get("detail"))}
    elif kind == Kind.EFFECT:
        detail.tool = {"name": obs.get("name"), "args": None,
                       "result": clip.value(obs.get("value")), "images": []}
    if not cassette.verified:
        detail.notes.append(cassette.verify_note)
    detail.truncated = clip.truncated
    return detail


# ---------------------------------------------------------------------- fork


def fork_document(path: str | Path, seq: int) -> Any:
    """The editable document of step ``seq`` (what ``deja fork --show-document`` prints)."""
    return edit.view(_observation(load_cassette(path), seq))


def side_effect_tools(path: str | Path, seq: int) -> list[str]:
    """The side-effecting tools the recorded run called after step ``seq``: those a fork
    there may let run live (the Fork panel's choice)."""
    return sorted({name for _, name in side_effects_after(load_cassette(path), seq)})


def fork_warnings(path: str | Path, seq: int, live_tools: Sequence[str] = ()) -> list[str]:
    """What to say before a fork at ``seq`` runs: the side-effecting tools the recorded
    run called after it and what the fork does with them (run for real only those in
    ``live_tools``), and, for a run recorded through the proxy, that the agent's own tools
    run for real."""
    parent = load_cassette(path)
    policy = ToolPolicy.parse(live=live_tools)
    said = [w for w in (side_effect_warning(parent, seq, policy),) if w]
    if isinstance(parent.header.get("proxy"), dict):
        said.append("this run was recorded through deja proxy: deja serves the model's "
                    "answers, but the agent's own tools run in its process, for real")
    return said


def document_text(document: Any) -> str:
    return json.dumps(document, indent=2, ensure_ascii=False, default=repr)


def _parse_edit(text: str) -> tuple[dict[str, Any], str | None]:
    """The fork arguments for an edit text: a replacement document, or a JSON patch list."""
    try:
        doc = json.loads(text)
    except ValueError as exc:
        return {}, f"the edit is not valid JSON: {exc}"
    if isinstance(doc, list):
        return {"patch": doc}, None
    if doc is None:
        return {}, "the edit is null; give the whole document (or a JSON patch list)"
    return {"replace": doc}, None


def validate_edit(path: str | Path, seq: int, text: str) -> str | None:
    """Why forking step ``seq`` with ``text`` would fail (None: it would not).

    ``text`` is the edited document, or an RFC 6902 patch (a JSON list of operations).
    The check is ``plan_fork``'s own (parent signature, step, edit); nothing is written.
    """
    args, error = _parse_edit(text)
    if error:
        return error
    try:
        plan_fork(path, seq, **args)
    except DejaError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


class LaunchedFork(NamedTuple):
    """A ``deja fork`` process started by the viewer."""

    path: Path  # the new cassette (it exists once the fork has started writing)
    process: subprocess.Popen[bytes]
    log: Path  # the process's stdout and stderr
    parent: Path
    seq: int
    live_url: str | None = None  # its ANTHROPIC_BASE_URL, when the viewer set one


_MESSAGES_PATH = "/v1/messages"


def recorded_base_url(path: str | Path) -> str | None:
    """The Anthropic base URL the run called, from its first Anthropic model step: the
    request URL without ``/v1/messages`` (scheme, host, port and any path prefix, never
    user info or a query), e.g. ``http://127.0.0.1:8765``. None when it made no such
    call. A fork's live target defaults to it: the steps after the fork go where the
    run went."""
    for obs in load_cassette(path).observations:
        if obs.get("kind") != Kind.MODEL or obs.get("provider", "anthropic") != "anthropic":
            continue
        parts = urlsplit(str(obs.get("url") or ""))
        if parts.scheme not in ("http", "https") or not parts.hostname:
            continue
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        port = f":{parts.port}" if parts.port else ""
        prefix = parts.path
        if prefix.endswith(_MESSAGES_PATH):
            prefix = prefix[:-len(_MESSAGES_PATH)]
        elif "/v1/" in prefix:  # another endpoint (count_tokens, batches): its prefix
            prefix = prefix[:prefix.index("/v1/")]
        return f"{parts.scheme}://{host}{port}{prefix.rstrip('/')}"
    return None


_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w]*\.)*[A-Z]\w*(?:Error|Exception|Divergence|"
                             r"Exhausted|Detected|Open|Cancelled|Locked|Cassette)\b:?.*$")


def _origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}" if parts.scheme else url


def fork_failure(launched: LaunchedFork, log: str, returncode: int | None) -> str:
    """Why a fork process failed, in one line: from the step that failed in the fork's
    cassette when there is one (``connection refused to http://127.0.0.1:9``), else the
    error its log ends with (deja's own message, or the last exception of a traceback),
    else its exit status."""
    try:
        observations = load_cassette(launched.path).observations if launched.path.exists() \
            else []
    except (DejaError, OSError):
        observations = []
    for obs in reversed(observations):
        err = obs.get("error")
        if obs.get("kind") in (Kind.MODEL, Kind.HTTP) and isinstance(err, dict):
            where = _origin(str(obs.get("url") or launched.live_url or ""))
            text = f"{err.get('type')}: {err.get('message')}"
            if "refused" in text.lower():
                return f"connection refused to {where}"
            return f"{text} ({obs['kind']} step {obs.get('seq')} to {where})"
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith("Error: "):  # deja's own message (click's prefix)
            return line.removeprefix("Error: ")
    errors = [line for line in lines if _EXCEPTION_LINE.match(line)]
    if errors:
        last = errors[-1]
        if "refused" in " ".join(errors).lower() and launched.live_url:
            return f"connection refused to {_origin(launched.live_url)} ({last})"
        return last
    return f"the fork exited with status {returncode}"


def launch_fork(path: str | Path, seq: int, document: Any, *, live_url: str | None = None,
                out_dir: str | Path | None = None,
                live_tools: Sequence[str] = ()) -> LaunchedFork:
    """Start ``deja fork PATH --at SEQ --replace FILE -o OUT`` (``--patch`` for a patch
    list) in the background; ``live_url`` becomes its ANTHROPIC_BASE_URL, and each of
    ``live_tools`` a ``--live-tool`` (a side effect run for real)."""
    path = Path(path)
    if isinstance(document, str):
        args, error = _parse_edit(document)
        if error:
            raise EditError(error)
        document = args.get("patch", args.get("replace"))
    folder = Path(out_dir) if out_dir is not None else path.parent
    out = folder / f"{path.stem}-fork{seq}-{secrets.token_hex(3)}.jsonl"
    work = Path(tempfile.mkdtemp(prefix="deja-view-fork-"))
    edit_file = work / "edit.json"
    edit_file.write_text(json.dumps(document, ensure_ascii=False), encoding="utf-8")
    option = "--patch" if isinstance(document, list) else "--replace"
    env = dict(os.environ)
    if live_url:
        env["ANTHROPIC_BASE_URL"] = live_url
    log = work / "fork.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "deja", "fork", str(path), "--at", str(seq), option,
             str(edit_file), "-o", str(out),
             *(f"--live-tool={name}" for name in live_tools)],
            stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    return LaunchedFork(out, process, log, path, seq, live_url or None)


_ENDED_LOGS: dict[Path, str] = {}  # the log of a fork that ended, its folder removed
_ENDED_LOCK = threading.Lock()


def fork_state(launched: LaunchedFork, tail: int = 200_000) -> dict[str, Any]:
    """How a launched fork is doing: running or its exit status, its run id, its log
    (the last ``tail`` characters), and for a failed one ``reason``, in one line. Once
    it has ended, its log is kept here and its private folder (the edit and the log)
    removed."""
    code = launched.process.poll()
    header = peek_header(launched.path)  # the fork is still writing it: never trusted
    run = header.get("run") if header is not None else None
    with _ENDED_LOCK:
        log = _ENDED_LOGS.get(launched.log)
        if log is None:
            try:
                log = launched.log.read_text(encoding="utf-8", errors="replace")[-tail:]
            except FileNotFoundError:
                log = ""
            if code is not None:
                _ENDED_LOGS[launched.log] = log
                shutil.rmtree(launched.log.parent, ignore_errors=True)
    failed = code is not None and (code != 0 or not launched.path.exists())
    return {"running": code is None, "returncode": code, "run": run,
            "exists": launched.path.exists(), "log": log,
            "reason": fork_failure(launched, log, code) if failed else None,
            "progress": read_status(run) if run else None}
