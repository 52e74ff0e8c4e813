"""The operations on runs and schedules, shared by ``deja serve`` (HTTP) and the CLI: each
takes the store and the engine's client and returns JSON-ready records."""

from __future__ import annotations

import logging
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from deja.runs import schedules
from deja.runs.config import cassette_dir
from deja.runs.errors import BadRunRequest, DatabaseUnavailable, NoSuchSchedule
from deja.runs.guard import bad_text
from deja.runs.spec import validate, workflow_id
from deja.runs.store import DISK_ERROR, ENDED, Store
from recorder.ask import seal_answer
from recorder.cassette.schema import run_status
from recorder.errors import NoSuchRun
from recorder.harness.progress import cassette_end, valid_run_id
from recorder.launch import new_run_id

log = logging.getLogger("deja.runs")

MOVES = 5  # reads of a run a cancel makes while other callers move it
LIFECYCLE = ("queued", "working", "input_required", "completed", "failed", "cancelled",
             "exhausted", "stopped", "interrupted", "needs_attention")


def lifecycle(row: dict[str, Any], engine: dict[str, Any] | None,
              end: dict[str, Any] | None = None) -> str:
    """A run's status (:func:`recorder.cassette.schema.run_status`): the end line of its
    cassette first, then deja's row and the engine's view of its current part."""
    return run_status(end, _queued_state(row, engine))


def _queued_state(row: dict[str, Any], engine: dict[str, Any] | None) -> str:
    """What deja's row and the engine say of a run while its cassette has no final end
    line."""
    status = row["status"]
    state = (engine or {}).get("status")
    if state == "CANCELLED":
        return "cancelled"
    if state in ("ERROR", "MAX_RECOVERY_ATTEMPTS_EXCEEDED"):
        return "failed"
    if state in ("ENQUEUED", "DELAYED"):
        return "queued"
    if state == "PENDING":
        return status if status in ("working", "input_required") else "working"
    if state == "SUCCESS" and status in ("queued", "working"):
        output = (engine or {}).get("output")  # the step ended, its row not yet written
        if isinstance(output, dict) and output.get("status") in LIFECYCLE:
            return str(output["status"])
    return str(status)


def _with_artefacts(row: dict[str, Any]) -> dict[str, Any]:
    """The row with the artefacts its run's record shows (:func:`record_of`): a run whose
    end line says completed while its worker is still writing the row already has them."""
    if row.get("artefacts") or row["status"] not in ("queued", "working"):
        return row
    end = end_of(row)
    if end is None or run_status(end, row["status"]) != "completed":
        return row
    return {**row, "artefacts": schedules.verified_artefacts(row["spec"])}


def end_of(row: dict[str, Any]) -> dict[str, Any] | None:
    """The end line of the run's cassette, if it has one (read from the file's tail)."""
    cassette = (row.get("spec") or {}).get("cassette")
    return cassette_end(cassette)[1] if cassette else None


def current_workflow(row: dict[str, Any]) -> str:
    return workflow_id(row["run_id"], int(row.get("attempt") or 0))


def record_of(row: dict[str, Any], engine: dict[str, Any] | None) -> dict[str, Any]:
    """The progress record of a run (seed 001's shape) with its lifecycle status."""
    progress = dict(row.get("progress") or {})
    end = end_of(row)
    status = lifecycle(row, engine, end)
    if end is not None and status == run_status(end):  # the step the end line closed
        progress["step"] = f"ended: {status}"
    out: dict[str, Any] = {
        "run_id": row["run_id"], "status": status,
        "command": row["spec"]["command"], "labels": row.get("labels") or {},
        "submitted": _iso(row["created"]), "updated": _iso(row["updated"]),
        "worker": row.get("worker") or (engine or {}).get("executor"),
        "cassette": row["spec"]["cassette"],
        "turn": progress.get("turn"), "turn_limit": progress.get("turn_limit"),
        "step": progress.get("step"), "elapsed_s": progress.get("elapsed_s"),
        "budget_s": progress.get("budget_s"), "tokens": progress.get("tokens"),
        "token_limit": progress.get("token_limit"), "spend_usd": progress.get("spend_usd"),
        "dollar_limit": progress.get("dollar_limit"),
        "artefacts": row.get("artefacts") or (
            # ended, its worker not done with its bookkeeping yet: what the worker will store
            schedules.verified_artefacts(row["spec"]) if status == "completed" and
            row["status"] in ("queued", "working") else []),
        "cancel": f"deja cancel {row['run_id']}",
    }
    if status == "input_required":
        out["question"] = row.get("question")
        out["answer"] = f"deja answer {row['run_id']} TEXT"
    if (engine or {}).get("cancel_requested"):
        out["cancel_requested"] = True
    error = row.get("error") or (engine or {}).get("error")
    if end is not None and status == run_status(end) and row["status"] != status:
        error = schedules.end_error(end)  # the end line says more than the row, not updated yet
    if error and status != "completed":  # a completed run's error is an earlier part's
        out["error"] = error
        if progress.get("stderr_tail"):  # the last lines its launcher wrote (redacted)
            out["stderr_tail"] = progress["stderr_tail"]
    if row.get("schedule"):
        out["schedule"] = row["schedule"]
        out["occurrence"] = row["occurrence"]
    if row.get("ended"):
        out["ended"] = _iso(row["ended"])
    elif status in ENDED and end is not None:  # when the end line was written
        try:
            out["ended"] = _iso(os.stat(row["spec"]["cassette"]).st_mtime)
        except OSError:
            out["ended"] = _iso(row["updated"])
    return out


def _iso(stamp: float | None) -> str | None:
    if stamp is None:
        return None
    return datetime.fromtimestamp(stamp, UTC).isoformat(timespec="seconds")


class Runs:
    """Submit, read, cancel and answer runs; keep schedules."""

    def __init__(self, store: Store, client: Any) -> None:
        self.store = store
        self.client = client

    def submit(self, payload: Any, *, default_cwd: Path | None = None) -> dict[str, Any]:
        given = payload.get("run_id") if isinstance(payload, dict) else None
        if given is not None and not valid_run_id(given):
            raise BadRunRequest(f"{given!r} is not a run id")
        spec = validate(payload, run_id=given or new_run_id(), cassettes=cassette_dir(),
                        default_cwd=default_cwd)
        run_id = spec["run_id"]
        if not self.store.add_run(run_id, spec):
            return {"run_id": run_id, "status": "queued"}  # the same submission again
        # The row and the engine's queue are one unit: a row whose run the engine could not
        # take is removed (the caller is told it failed); one left by a crash in between is
        # removed by a worker (runs.worker.reconcile).
        try:
            self.client.submit(spec)
        except BaseException:
            try:
                self.store.forget_submission(run_id)
            except DatabaseUnavailable as exc:  # a worker removes it once it can
                log.warning("run %s: its failed submission is still in the database (%s)",
                            run_id, exc)
            raise
        return {"run_id": run_id, "status": "queued"}

    def _row(self, run_id: str) -> dict[str, Any]:
        row = self.store.get_run(run_id) if valid_run_id(run_id) else None
        if row is None:
            raise NoSuchRun(f"no run {run_id!r} in the runs database ({_where(self.store)}); "
                            "`deja runs` lists the runs it holds")
        return row

    def _engine(self, rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """The engine's view of each row's current workflow, by run id.

        A working run that was cancelled goes on to its next boundary: while its worker is
        alive it is still ``working`` (with ``cancel_requested``), then ``cancelled``.
        """
        ids = {current_workflow(row): row["run_id"] for row in rows}
        states = {ids[wf]: state for wf, state in self.client.states(list(ids)).items()
                  if wf in ids}
        stopping = [row for row in rows if row["status"] == "working" and
                    (states.get(row["run_id"]) or {}).get("status") == "CANCELLED"]
        if stopping:
            from deja.runs.locks import live_workers

            alive = live_workers(self.store)
            for row in stopping:
                if row.get("worker") in alive:
                    states[row["run_id"]] = {**states[row["run_id"]], "status": "PENDING",
                                             "cancel_requested": True}
        return states

    def get(self, run_id: str) -> dict[str, Any]:
        row = self._row(run_id)
        return record_of(row, self._engine([row]).get(run_id))

    def list_runs(self, *, status: list[str] | None = None, label: dict[str, str] | None = None,
             schedule: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        bad = [s for s in status or [] if s not in LIFECYCLE]
        if bad:
            raise BadRunRequest(f"unknown status {', '.join(bad)}; valid: {', '.join(LIFECYCLE)}")
        # A run's status can differ from its row's (the engine knows better while the row
        # says it is active; an end line written since, a run resumed by hand, wins over
        # both): a filtered list looks at the newest rows whatever their status.
        rows = self.store.list_runs(schedule=schedule,
                                    limit=max(limit, 1) * 4 if label or status else limit * 2)
        states = self._engine(rows)
        out = []
        for row in rows:
            record = record_of(row, states.get(row["run_id"]))
            if status and record["status"] not in status:
                continue
            if label and any(record["labels"].get(k) != v for k, v in label.items()):
                continue
            out.append(record)
        return out[:limit]

    def cancel(self, run_id: str) -> dict[str, Any]:
        for _ in range(MOVES):  # the run moved between reading it and writing: read again
            row = self._row(run_id)
            record = record_of(row, self._engine([row]).get(run_id))
            # A run interrupted by its cassette directory is dispatched again once it is
            # writable (runs.worker.reconcile): it has not ended until then.
            stalled = row["status"] == "interrupted" and \
                str(row.get("error") or "").startswith(DISK_ERROR)
            if record["status"] in ENDED and not stalled:
                return {**record, "note": f"the run already ended {record['status']}"}
            # Its current part too, whatever the run shows: a waiting run's part has ended,
            # unless its worker died before the engine recorded that, and a pending part is
            # taken up again when a worker starts (the engine leaves an ended part as it is).
            self.client.cancel(current_workflow(row))
            if record["status"] not in ("queued", "input_required") and not stalled:
                return {"run_id": run_id, "status": "cancelling", "was": record["status"]}
            # Only if the row is as read, unwritten since: a worker that took the run up
            # meanwhile stops it at its next boundary; an answer that came meanwhile made a
            # part, cancelled on the next read.
            if self.store.move_run(run_id, row["status"], int(row.get("attempt") or 0),
                                   unchanged_since=row["updated"], status="cancelled",
                                   question=None):
                return {"run_id": run_id, "status": "cancelled", "was": record["status"]}
        return {"run_id": run_id, "status": "cancelling", "was": record["status"]}

    def answer(self, run_id: str, text: str) -> dict[str, Any]:
        if not isinstance(text, str):
            raise BadRunRequest("an answer is a string")
        why = bad_text(text)  # what the API refuses in its body, refused from the viewer too
        if why is not None:
            raise BadRunRequest(f"an answer cannot hold {why}")
        row = self._row(run_id)
        record = record_of(row, self._engine([row]).get(run_id))
        if record["status"] != "input_required":
            raise BadRunRequest(f"run {run_id} is {record['status']}, not waiting for an "
                                "answer (input_required); answer once it asks")
        question = row.get("question")
        attempt = int(row.get("attempt") or 0) + 1
        text = seal_answer(run_id, text)  # the engine keeps it: redacted (recorder.ask)
        # The part first (a crash before the row moves leaves it to run, answer and all),
        # then the row, only if it still waits: the part of a run cancelled meanwhile runs
        # nothing (it finds the row cancelled), and the caller is told.
        self.client.answer(row["spec"], text, attempt)  # the same answer twice: one part
        if not self.store.move_run(run_id, ("input_required", "working"), attempt - 1,
                                   status="queued", attempt=attempt):
            now = self._row(run_id)
            if now["status"] == "cancelled" and int(now.get("attempt") or 0) < attempt:
                self.client.cancel(workflow_id(run_id, attempt))
                raise BadRunRequest(f"run {run_id} was cancelled as it was answered; the "
                                    "answer is not used")
        if self.client.answer_of(run_id, attempt) != text:  # the engine kept another's
            raise BadRunRequest(f"run {run_id} was answered by another caller at the same "
                                "moment; that answer is used, not this one")
        return {"run_id": run_id, "status": record["status"], "question": question,
                "answered": True}

    # -- schedules

    def add_schedule(self, name: str, cron: str, tz: str, deadline: str | None,
                     alert: str | None, payload: dict[str, Any],
                     default_cwd: Path | None = None) -> dict[str, Any]:
        schedules.check_name(name)
        schedules.check_cron(cron)
        schedules.check_tz(tz)
        schedules.check_deadline(deadline)
        spec = validate(payload, run_id="s_template", cassettes=cassette_dir(),
                        default_cwd=default_cwd)
        spec.pop("run_id")
        spec.pop("cassette")
        spec["cassette_dir"] = str(cassette_dir())
        if not self.store.add_schedule(name, cron, tz, deadline, alert, spec):
            raise BadRunRequest(f"a schedule named {name!r} exists; `deja schedule rm {name}` "
                                "first, or choose another name")
        try:
            self.client.add_schedule(name, cron, tz)
        except Exception:
            self.store.remove_schedule(name)
            raise
        return self.schedule(name)

    def schedule(self, name: str) -> dict[str, Any]:
        row = self.store.schedule(name)
        if row is None:
            raise NoSuchSchedule(f"no schedule {name!r}; `deja schedule ls` lists them")
        last = next((r for r in map(_with_artefacts, self.store.list_runs(
            schedule=name, limit=20)) if r.get("artefacts")), None)
        alerts = self.store.alerts(schedule=name, limit=5)
        return {"name": name, "cron": row["cron"], "tz": row["tz"],
                "deadline": row["deadline"], "alert": row["alert"],
                "command": row["spec"]["command"],
                "next": schedules.next_occurrence(row).isoformat(),
                "last_verified_artefact": None if last is None else {
                    "run_id": last["run_id"], "occurrence": last["occurrence"],
                    "artefacts": last["artefacts"]},
                "alerts": [{k: a[k] for k in ("kind", "occurrence", "run_id", "message")} |
                           {"at": _iso(a["at"]), "delivery": a["delivery"]} for a in alerts]}

    def schedules(self) -> list[dict[str, Any]]:
        return [self.schedule(row["name"]) for row in self.store.schedules()]

    def remove_schedule(self, name: str) -> dict[str, Any]:
        if not self.store.remove_schedule(name):
            raise NoSuchSchedule(f"no schedule {name!r}; `deja schedule ls` lists them")
        self.client.remove_schedule(name)
        return {"name": name, "removed": True}

    def run_now(self, name: str) -> dict[str, Any]:
        """Submit an occurrence of ``name`` for this second (its deterministic id)."""
        self.schedule(name)
        when = datetime.now(UTC).replace(microsecond=0)
        spec = schedules.occurrence(self.store, name, when.isoformat())
        if spec is None:
            raise NoSuchSchedule(f"no schedule {name!r}; `deja schedule ls` lists them")
        self.client.submit(spec)
        return {"name": name, "triggered": True, "run_id": spec["run_id"],
                "at": when.isoformat()}


def _where(store: Store) -> str:
    from deja.runs.config import safe_url

    return safe_url(store.url)
