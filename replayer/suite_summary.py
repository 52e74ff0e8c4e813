"""A suite's summary: one JSON document per run of ``deja suite`` or ``deja sweep``, left
behind for the viewer (and for CI to keep) after the table is printed.

**Where it goes.** ``FOLDER/.deja/suites/<suite id>.json`` (:func:`default_path`), where
FOLDER is the folder of the runs the suite made: OUTDIR, the new cassettes of a ``--then``
suite, or a sweep's forks; the incidents' folder DIR for a plain replay, which writes no
cassette. That is the folder whose viewer (``deja view FOLDER``) opens every run the
summary names through the addresses it already has: the new cassettes are runs of the
folder, and each incident is their parent, reached through their fork tree (``via``), with
the diff of the two; a plain replay's incidents are runs of DIR. The ``.deja`` folder is
hidden and holds no ``*.jsonl``: nothing that lists a folder's cassettes (a suite, the
index, the pytest marker) sees it. A suite run again under its id replaces its summary.
The document is written whole or not at all (a temporary file in the same folder, then
renamed over it), so a reader never sees half of one.

**What it holds.** ``format`` (:data:`FORMAT`), ``suite`` (its id), ``kind`` (``suite`` or
``sweep``), ``mode`` (:data:`MODES`), ``when`` and ``ended`` (UTC), ``command`` (the
command given, its secrets redacted; None: each incident's recorded command), ``folder``
(the incidents'), ``output`` (the new cassettes'), ``where`` (inline or on the workers),
``incidents`` (one :func:`suite_entry` or sweep entry each: ``incident``, ``cassette``,
``run``, ``verdict``, ``changed_at``, ``change``, ``recorded`` and ``now`` (``status``,
``exit_code``), ``new_cassette``, ``new_run``, ``live`` (``model_calls``, ``tool_calls``,
``http_calls``, ``cost_usd``), ``seconds``, ``error``, ``worker``) and ``totals`` (what
the suite's ``--json`` calls its summary, or a sweep's counts).

**Read back, it is untrusted** (anyone who can write the folder can write it): :func:`read`
takes a document of at most :data:`MAX_BYTES`, keeps only the fields above, each of its
type (anything else is None), and refuses what is not a summary with a
:class:`SummaryError` saying why. Its strings are shown as text, never as markup.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from recorder.capture.redact import DEFAULT
from recorder.cassette.reader import peek_header
from recorder.cassette.schema import utc_stamp
from replayer import suite as suites

__all__ = ["FORMAT", "MAX_BYTES", "MODES", "SummaryError", "default_path", "document", "find",
           "mode_of", "path_of", "read", "suite_entry", "sweep_entries", "sweep_totals",
           "verdict_text", "write"]

FORMAT = "deja-suite-summary/1"
MODES = ("replay", "then live", "then stub", "sweep")
MAX_BYTES = 8 * 1024 * 1024  # a summary larger than this is not read
TEXT_LIMIT = 4000  # characters of one string kept when a summary is read
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,149}")
_LIVE = ("model_calls", "tool_calls", "http_calls", "cost_usd")


class SummaryError(ValueError):
    """A file that is not a suite's summary (or cannot be read as one)."""


def default_path(folder: str | Path, suite_id: str) -> Path:
    """Where the summary of suite ``suite_id`` goes: ``FOLDER/.deja/suites/<id>.json``."""
    return Path(folder) / ".deja" / "suites" / f"{suite_id}.json"


def path_of(folder: str | Path, suite_id: str) -> Path | None:
    """The summary of ``suite_id`` in ``folder``, by the id alone (a name, never a path:
    None for an id with a ``/`` or that starts with a dot)."""
    return default_path(folder, suite_id) if _ID.fullmatch(suite_id) else None


def mode_of(then: str | None) -> str:
    """A suite's mode: ``replay``, or ``then live`` / ``then stub``."""
    return "replay" if then is None else f"then {then}"


# --------------------------------------------------------------------------- writing

def _new_run(path: str | None) -> str | None:
    header = peek_header(path) if path else None
    run = header.get("run") if header else None
    return run if isinstance(run, str) else None


def _absolute(path: Any) -> str | None:
    return str(Path(path).resolve()) if isinstance(path, str) and path else None


def _state(state: Any) -> dict[str, Any] | None:
    if not isinstance(state, Mapping):
        return None
    return {"status": state.get("status"), "exit_code": state.get("exit_code")}


def suite_entry(record: Mapping[str, Any], cassette: str | Path) -> dict[str, Any]:
    """An incident's entry, from its record (:mod:`replayer.suite`); ``cassette`` is the
    incident's file."""
    live = record.get("live") or {}
    new = _absolute(record.get("new_cassette"))
    return {"incident": record.get("incident"), "cassette": str(Path(cassette).resolve()),
            "run": record.get("run"), "verdict": record.get("verdict"),
            "changed_at": record.get("changed_at"), "change": record.get("change"),
            "recorded": _state(record.get("recorded")), "now": _state(record.get("now")),
            "new_cassette": new, "new_run": _new_run(new),
            "live": {k: live.get(k, 0) for k in _LIVE},
            "seconds": record.get("seconds"), "error": record.get("error"),
            "worker": record.get("worker")}


def sweep_entries(report: Any) -> list[dict[str, Any]]:
    """A sweep's entries (a :class:`replayer.sweep.SweepReport`), one per fork: its
    perturbation is the change (``changed_at`` its step), its fork the new cassette, its
    parent the cassette."""
    parent = str(Path(report.cassette).resolve())
    out = []
    for row in report.rows:
        p = row.perturbation
        verdict = "error" if row.error is not None else (
            "outcome_changed" if row.changed else "same_outcome")
        fork = _absolute(row.cassette)
        out.append({"incident": Path(row.cassette).stem, "cassette": parent,
                    "run": report.run, "verdict": verdict, "changed_at": p.step,
                    "change": f"{p.step_kind} {p.target}: {p.label}",
                    "recorded": {"status": report.status, "exit_code": None},
                    "now": {"status": row.status, "exit_code": row.exit_code},
                    "new_cassette": fork, "new_run": _new_run(fork),
                    "live": {k: row.live.get(k, 0) for k in _LIVE},
                    "seconds": round(row.seconds, 3), "error": row.error,
                    "worker": row.worker})
    return out


def sweep_totals(report: Any, seconds: float) -> dict[str, Any]:
    """A sweep's counts: forks, how many changed the outcome or could not run, what the
    forks spent live, the wall-clock seconds and the status ``deja sweep`` exits with."""
    live = dict.fromkeys(_LIVE, 0)
    for row in report.rows:
        for key in _LIVE:
            live[key] += row.live.get(key, 0) or 0
    live["cost_usd"] = round(live["cost_usd"], 6)
    return {"forks": len(report.rows), "outcome_changed": len(report.changed),
            "error": len(report.errors), "live": live, "seconds": round(seconds, 3),
            "exit_status": report.exit_code}


def document(suite_id: str, *, kind: str, mode: str, when: str, command: Sequence[str] | None,
             folder: str | Path, output: str | Path | None, where: str,
             entries: list[dict[str, Any]], totals: Mapping[str, Any]) -> dict[str, Any]:
    """The summary document (see the module); ``when`` is when the suite started."""
    return {"format": FORMAT, "suite": suite_id, "kind": kind, "mode": mode, "when": when,
            "ended": utc_stamp("seconds"),
            "command": DEFAULT.argv(command) if command else None,
            "folder": str(Path(folder).resolve()),
            "output": str(Path(output).resolve()) if output is not None else None,
            "where": where, "incidents": entries, "totals": dict(totals)}


def write(path: str | Path, summary: Mapping[str, Any]) -> Path:
    """Write ``summary`` to ``path`` whole: a temporary file beside it, synced, then
    renamed over it. Raises OSError."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp",
                                     dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            json.dump(summary, out, indent=2, ensure_ascii=False, default=str)
            out.write("\n")
            out.flush()
            os.fsync(out.fileno())
        os.chmod(temporary, 0o644)  # as the cassettes beside it (mkstemp makes it 0600)
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return target


# --------------------------------------------------------------------------- reading

def _text(value: Any) -> str | None:
    return value[:TEXT_LIMIT] if isinstance(value, str) else None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _number(value: Any) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else 0.0


def _clean_state(value: Any) -> dict[str, Any] | None:
    if not isinstance(value, Mapping):
        return None
    return {"status": _text(value.get("status")), "exit_code": _int(value.get("exit_code"))}


def _clean_entry(raw: Any) -> dict[str, Any] | None:
    if not isinstance(raw, Mapping):
        return None
    found = raw.get("live")
    live: Mapping[str, Any] = found if isinstance(found, Mapping) else {}
    return {**{k: _text(raw.get(k)) for k in ("incident", "cassette", "run", "verdict",
                                               "change", "new_cassette", "new_run", "error",
                                               "worker")},
            "changed_at": _int(raw.get("changed_at")),
            "recorded": _clean_state(raw.get("recorded")), "now": _clean_state(raw.get("now")),
            "live": {k: (_number(live.get(k)) if k == "cost_usd" else
                         int(_number(live.get(k)))) for k in _LIVE},
            "seconds": _number(raw.get("seconds"))}


def read(path: str | Path) -> dict[str, Any]:
    """The summary at ``path``, checked and cleaned (see the module); a
    :class:`SummaryError` for a file that is not one."""
    try:
        with Path(path).open("rb") as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as exc:
        raise SummaryError(f"cannot be read: {exc.strerror or exc}") from None
    if len(data) > MAX_BYTES:
        raise SummaryError(f"is over {MAX_BYTES // (1024 * 1024)} MB: not a summary deja wrote")
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError):
        raise SummaryError("is not JSON") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise SummaryError(f"is not a suite's summary (no \"format\": \"{FORMAT}\")")
    entries = raw.get("incidents")
    if not isinstance(entries, list):
        raise SummaryError("has no list of incidents")
    command = raw.get("command")
    return {**{k: _text(raw.get(k)) for k in ("suite", "kind", "mode", "when", "ended",
                                               "folder", "output", "where")},
            "command": [a[:TEXT_LIMIT] for a in command if isinstance(a, str)]
            if isinstance(command, list) else None,
            "incidents": [e for e in map(_clean_entry, entries) if e is not None],
            "totals": raw.get("totals") if isinstance(raw.get("totals"), dict) else {}}


def _age(path: Path) -> tuple[int, str]:
    try:
        return path.stat().st_mtime_ns, path.name
    except OSError:
        return 0, path.name


def find(folder: str | Path) -> list[tuple[str, dict[str, Any] | SummaryError]]:
    """The summaries of ``folder`` (``.deja/suites/*.json``), newest first: each one's id
    (its file's name) and the summary, or why it is not one."""
    where = Path(folder) / ".deja" / "suites"
    try:
        files = [p for p in where.iterdir() if p.suffix == ".json"
                 and _ID.fullmatch(p.stem) and p.is_file()]
    except OSError:
        return []
    files.sort(key=_age, reverse=True)
    found: list[tuple[str, dict[str, Any] | SummaryError]] = []
    for path in files:
        try:
            found.append((path.stem, read(path)))
        except SummaryError as exc:
            found.append((path.stem, exc))
    return found


# --------------------------------------------------------------------------- showing

def verdict_text(entry: Mapping[str, Any], kind: str | None = "suite") -> str:
    """An entry's verdict in words: a suite's (:func:`replayer.suite.headline`), or, for
    ``kind`` ``sweep``, a fork's (``changed the outcome (step 3 tool search: error)``)."""
    if kind != "sweep":
        return suites.headline(entry)
    said = {"outcome_changed": "changed the outcome", "same_outcome": "same outcome",
            "error": "could not run"}.get(str(entry.get("verdict")), str(entry.get("verdict")))
    return f"{said} (step {entry.get('changed_at')} {entry.get('change')})"
