"""A submitted run: what ``POST /runs`` (and ``deja submit``) accepts, checked before
anything is stored, and the ``deja record`` / ``deja resume`` command lines a worker runs.

A submission is JSON::

    {"command": ["python", "agent.py"], "cwd": "/srv/agents",
     "labels": {"team": "billing"},
     "guards": {"max_turns": 60, "max_dollars": 5, "max_seconds": 3600,
                "max_tokens": 400000, "max_tokens_per_turn": 4096,
                "clamp_max_tokens": false, "loop_guard": true, "breaker": true}}

Everything but ``command`` is optional. The command line is stored in the runs database
for the worker to run, so it must not hold a secret: an argument that deja's redaction
would hide (``--api-key X``, ``sk-…``) is refused with the fix (pass secrets through the
worker's environment, which is never stored). Nor may any string hold a NUL character or
a lone surrogate, which neither a database nor a command line can carry.

A caller may choose the run's id (``"run_id"``: submitting the same id twice is one run).
Submitted ids have a namespace of their own: letters, digits, ``_`` and ``-``, never
``.`` (the parts of a run answered are ``<run>.1``, ``<run>.2``, ...), and never starting
with ``s_`` (a schedule's occurrences are ``s_<name>_<UTC time>``). deja's own ids are
``r_`` followed by 20 hex digits.
"""

from __future__ import annotations

import math
import os
import re
import sys
from pathlib import Path
from typing import Any

from deja.runs.errors import BadRunRequest
from recorder.capture.redact import DEFAULT
from recorder.harness.progress import valid_run_id

GUARDS = {"max_turns": int, "max_tokens": int, "max_tokens_per_turn": int,
          "clamp_max_tokens": bool, "max_seconds": float, "max_dollars": float,
          "loop_guard": bool, "breaker": bool}
_SUBMITTED_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")
_FLAGS = {"max_turns": "--max-turns", "max_tokens": "--max-tokens",
          "max_tokens_per_turn": "--max-tokens-per-turn", "max_seconds": "--max-seconds",
          "max_dollars": "--max-dollars"}


def _shown(value: Any) -> str:
    """``repr(value)``, cut short: a message never echoes a whole body back."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


def _storable(text: str, what: str) -> str:
    """``text``, unless it holds what no database or command line carries."""
    found = re.search("[\x00\ud800-\udfff]", text)
    if found is not None:
        kind = "a NUL character" if found.group() == "\x00" else \
            f"a lone surrogate (U+{ord(found.group()):04X})"
        raise BadRunRequest(f"{what} holds {kind}, which a command line and the runs "
                            "database cannot carry")
    return text


def check_submitted_id(run_id: Any) -> str:
    """A caller's own run id, in the namespace of submitted runs."""
    if not isinstance(run_id, str) or _SUBMITTED_ID.fullmatch(run_id) is None:
        raise BadRunRequest(f"run_id {_shown(run_id)} is not a submitted run's id: 1 to "
                            "128 letters, digits, '_' and '-' (no '.': a run's later parts "
                            "are <run>.1, <run>.2, ...), e.g. invoice-7-2026")
    if run_id.startswith("s_"):
        raise BadRunRequest(f"run_id {run_id!r} starts with s_, which names a schedule's "
                            "occurrences (s_<name>_<UTC time>); choose another id")
    return run_id


def _command(payload: dict[str, Any]) -> list[str]:
    command = payload.get("command")
    if isinstance(command, str):
        raise BadRunRequest("'command' is a list of arguments, e.g. [\"python\", \"agent.py\"], "
                            "not one string")
    if not isinstance(command, list) or not command or \
            not all(isinstance(arg, str) and arg for arg in command):
        raise BadRunRequest("'command' must be a non-empty list of non-empty strings, e.g. "
                            "[\"python\", \"agent.py\"]")
    for i, arg in enumerate(command):
        _storable(arg, f"argument {i} of the command")
    hidden = DEFAULT.argv(command)
    for i, (given, kept) in enumerate(zip(command, hidden, strict=True)):
        if given != kept:
            raise BadRunRequest(
                f"argument {i} of the command looks like a secret ({kept!r} once redacted); "
                "a submitted command is stored in the runs database, so pass secrets through "
                "the worker's environment instead")
    return list(command)


def _guards(payload: dict[str, Any]) -> dict[str, Any]:
    guards = payload.get("guards") or {}
    if not isinstance(guards, dict):
        raise BadRunRequest("'guards' must be an object, e.g. {\"max_turns\": 60}")
    out: dict[str, Any] = {}
    for key, value in guards.items():
        kind = GUARDS.get(key)
        if kind is None:
            raise BadRunRequest(f"unknown guard {_shown(key)}; valid: {', '.join(GUARDS)}")
        if kind is bool:
            if not isinstance(value, bool):
                raise BadRunRequest(f"guard {key!r} is true or false, not {_shown(value)}")
        elif isinstance(value, bool) or not isinstance(value, int | float) or \
                not math.isfinite(value) or value < 0 or \
                (kind is int and not float(value).is_integer()):
            raise BadRunRequest(f"guard {key!r} must be a non-negative "
                                f"{'integer' if kind is int else 'number'}, not "
                                f"{_shown(value)}")
        out[key] = kind(value)
    return out


def _labels(payload: dict[str, Any]) -> dict[str, str]:
    labels = payload.get("labels") or {}
    if not isinstance(labels, dict) or not all(
            isinstance(k, str) and k and isinstance(v, str) for k, v in labels.items()):
        raise BadRunRequest("'labels' must be an object of strings, e.g. {\"team\": \"billing\"}")
    for key, value in labels.items():
        _storable(key, f"label {key[:40]!r}")
        _storable(value, f"label {key[:40]!r}")
    return dict(DEFAULT.value(dict(labels)))  # stored and handed to the engine: redacted


def validate(payload: Any, *, run_id: str, cassettes: Path,
             default_cwd: Path | None = None) -> dict[str, Any]:
    """The stored form of a submission, or ``BadRunRequest`` saying what is wrong."""
    if not isinstance(payload, dict):
        raise BadRunRequest("a run is a JSON object, e.g. {\"command\": [\"python\", "
                            "\"agent.py\"]}")
    unknown = set(payload) - {"command", "cwd", "labels", "guards", "run_id"}
    if unknown:
        raise BadRunRequest(f"unknown field(s) {', '.join(_shown(k) for k in sorted(unknown))}"
                            "; valid: command, cwd, labels, guards, run_id")
    if "run_id" in payload:
        check_submitted_id(payload["run_id"])
    if not valid_run_id(run_id):
        raise BadRunRequest(f"{run_id!r} is not a run id")
    cwd = payload.get("cwd")
    if cwd is None:
        where = (default_cwd or Path.cwd()).resolve()
    elif not isinstance(cwd, str) or not os.path.isabs(cwd):
        raise BadRunRequest(f"'cwd' must be an absolute directory, not {_shown(cwd)}")
    else:
        where = Path(_storable(cwd, "'cwd'"))
    return {"run_id": run_id, "command": _command(payload), "cwd": str(where),
            "labels": _labels(payload), "guards": _guards(payload),
            "cassette": str(cassettes / f"{run_id}.jsonl")}


def workflow_id(run_id: str, attempt: int) -> str:
    """The engine workflow of a run's ``attempt``-th part: the submission, then one per
    answer (``<run>.1``, ``<run>.2``, ...)."""
    return run_id if attempt == 0 else f"{run_id}.{attempt}"


def part_of(workflow: str, run_id: str) -> int:
    """The part (attempt) of ``run_id`` that engine workflow ``workflow`` runs."""
    tail = workflow[len(run_id) + 1:] if workflow.startswith(f"{run_id}.") else ""
    return int(tail) if tail.isdigit() else 0


def deja_argv() -> list[str]:
    return [sys.executable, "-m", "deja"]


def record_argv(spec: dict[str, Any]) -> list[str]:
    """``deja record`` of a submitted run, into its cassette, with its guards and labels."""
    argv = [*deja_argv(), "record", "-o", spec["cassette"], "--run-id", spec["run_id"],
            "--force"]
    guards = spec.get("guards") or {}
    for key, flag in _FLAGS.items():
        if key in guards:
            argv += [flag, str(guards[key])]
    if guards.get("clamp_max_tokens"):
        argv.append("--clamp-max-tokens")
    if guards.get("loop_guard") is False:
        argv.append("--no-loop-guard")
    if guards.get("breaker") is False:
        argv.append("--no-breaker")
    for key, value in (spec.get("labels") or {}).items():
        argv += ["--label", f"{key}={value}"]
    return [*argv, "--", *spec["command"]]


def resume_argv(spec: dict[str, Any]) -> list[str]:
    """``deja resume`` of a submitted run whose cassette holds a recorded prefix."""
    return [*deja_argv(), "resume", spec["cassette"], "--cwd", spec["cwd"], "--",
            *spec["command"]]
