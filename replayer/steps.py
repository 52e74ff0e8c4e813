"""A cassette as rows: one flat row per step and one summary per run.

``deja show``, ``deja ls`` (through the DuckDB index) and the viewer all read runs in
this shape, so a step looks the same everywhere.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from recorder.cassette import Cassette

STEP_COLUMNS = ("seq", "kind", "name", "status", "input_tokens", "output_tokens", "cost_usd",
                "ms", "error")


def step_name(obs: dict[str, Any]) -> str:
    kind = obs.get("kind")
    if kind == "model":
        return str(obs.get("model") or obs.get("provider") or "model")
    if kind == "http":
        parts = urlsplit(obs.get("url", ""))
        return f"{obs.get('method', '')} {parts.netloc}{parts.path}"
    if kind in ("tool", "effect", "intent", "outcome"):
        return str(obs.get("name", ""))
    if kind == "control":
        return str(obs.get("event", ""))
    return ""


def step_status(obs: dict[str, Any]) -> str:
    kind = obs.get("kind")
    if kind in ("model", "http"):
        if "response" in obs:
            status = str(obs["response"].get("status"))
            if obs.get("api_error") and obs["response"].get("status") == 200:
                status += " stream-error"
            return status
        return "failed"
    if kind in ("tool", "outcome"):
        return "error" if "error" in obs else "ok"
    if kind == "end":
        return str(obs.get("status", ""))
    return "ok"


def step_error(obs: dict[str, Any]) -> str | None:
    err = obs.get("error") or obs.get("api_error")
    if not err:
        return None
    return f"{err.get('type')}: {err.get('message')}"


def step_row(obs: dict[str, Any]) -> dict[str, Any]:
    usage = obs.get("usage") or {}
    return {
        "seq": obs["seq"], "kind": obs["kind"], "name": step_name(obs),
        "status": step_status(obs),
        "input_tokens": usage.get("input_tokens"), "output_tokens": usage.get("output_tokens"),
        "cost_usd": obs.get("cost_usd"), "ms": obs.get("ms"), "error": step_error(obs),
    }


def step_rows(cassette: Cassette) -> list[dict[str, Any]]:
    return [step_row(obs) for obs in cassette.observations]


def run_summary(cassette: Cassette) -> dict[str, Any]:
    """Run-level facts: from the end line when there is one, else summed from the steps."""
    header, end = cassette.header, cassette.end
    rows = step_rows(cassette)
    totals = {
        "steps": len(rows),
        "model_calls": sum(1 for r in rows if r["kind"] == "model"),
        "tool_calls": sum(1 for r in rows if r["kind"] == "tool"),
        "input_tokens": sum(r["input_tokens"] or 0 for r in rows),
        "output_tokens": sum(r["output_tokens"] or 0 for r in rows),
        "cost_usd": round(sum(r["cost_usd"] or 0.0 for r in rows), 8),
        "errors": sum(1 for r in rows if r["error"]),
    }
    parent = header.get("parent") or {}
    models = sorted({r["name"] for r in rows if r["kind"] == "model"})
    return {
        "run": header.get("run"), "path": str(cassette.path), "created": header.get("created"),
        "status": (end or {}).get("status") or ("torn" if cassette.torn_offset is not None
                                               else "incomplete"),
        "parent_run": parent.get("run"), "parent_step": parent.get("step"),
        "duration_s": ((end or {}).get("totals") or {}).get("duration_s"),
        "models": models, "labels": header.get("labels") or {},
        "verified": cassette.verified, "verify_note": cassette.verify_note, **totals,
    }


def children_of(run: str, directory: str | Path) -> list[dict[str, Any]]:
    """Runs in ``directory`` forked from ``run``: reads only each cassette's header line."""
    out = []
    for path in sorted(Path(directory).glob("*.jsonl")):
        try:
            with path.open("rb") as f:
                header = json.loads(f.readline())
        except (OSError, ValueError, RecursionError):  # not a cassette, or a hostile one
            continue
        parent = header.get("parent") if isinstance(header, dict) else None
        if isinstance(parent, dict) and parent.get("run") == run:
            out.append({"run": header.get("run"), "step": parent.get("step"),
                        "path": str(path)})
    return out
