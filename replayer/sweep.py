"""What-if sweeps: fork one recorded run many times, each with one observation perturbed,
and see which perturbations change how the run ends.

A **rule** picks steps and the perturbations to try at each (``deja sweep --perturb``)::

    tool=search:error,empty     every step of tool search: once raising, once empty
    tool=*:timeout              every tool step: the tool raises TimeoutError
    model:429,529               every model step: the provider answers 429, then 529
    step=7:malformed            step 7 alone
    tool=search:other=B.jsonl   the same tool's result in another recording

Each perturbation is one edit document, the whole document of the step as the agent
will see it (:mod:`replayer.edit`); each is one fork (:mod:`replayer.fork`) at that step,
``deja fork CASSETTE --at N --replace EDIT -o OUT [-- CMD]``, run as a job of
:mod:`replayer.suite` (``deja sweep --job``, which ends with its record), here ``-j`` at a
time or by another runner of suite jobs. So the fork's edited step is what the agent saw,
its ``fork_edit`` line holds the patch from the recorded document to it, and its header
names the parent run and step, where the original is.

The perturbations of a tool step (a ``tool`` line, or a side effect's ``outcome``):

==============  ===========================================================================
``error``       the tool raises ``RuntimeError("injected by deja sweep")``
``timeout``     the tool raises ``TimeoutError``
``empty``       the tool returns an empty value of its recorded result's type: ``""``,
                ``[]``, ``{}``, else ``null``
``malformed``   the tool returns its recorded result's JSON text (its own text, for a
                string) cut in half: truncated JSON, and a string where a structure was
``other=FILE``  the tool returns (or raises) what its k-th call returned in the recording
                FILE, for the tool's k-th call here (FILE's last call, when it has fewer)
==============  ===========================================================================

A model step takes ``429`` and ``529``: the provider's own error response (the body its
API sends, ``application/json``, with ``retry-after: 0``, ``retry-after-ms: 100`` and
``x-should-retry: true``), served in place of the message, to a streaming request too. An
SDK that retries asks again, live.

**The final answer** of a run is the text of the reply of its last model step that got
one (a response with a status below 400 and no error; its text blocks joined by
newlines, whatever the provider); ``None`` when no model step did. A perturbation
**changes the outcome** when its fork's final answer differs from the recording's, or
its fork ends with another status (``completed``, ``failed``, ``stopped`` by a guard,
``exhausted`` ...). A fork that could not run at all (no cassette, no end line) is an
``error`` row, not a change.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from recorder import providers
from recorder.canonical import decode_body
from recorder.cassette import Cassette, load
from recorder.cassette.keys import Keyring, load_keyring
from recorder.cassette.rows import run_status, run_totals
from recorder.cassette.schema import Kind
from recorder.errors import ConfigError, DejaError, EditError, NoSuchStep, PathTaken
from recorder.providers import conversation
from replayer import edit, suite
from replayer.sweep_report import SweepReport, SweepRow

__all__ = ["MODEL_KINDS", "TOOL_KINDS", "Perturbation", "SweepJob", "SweepReport", "SweepRow",
           "SweepRule", "final_answer", "job_row", "plan_jobs", "plan_sweep", "record_row",
           "run_sweep"]

TOOL_KINDS = ("error", "timeout", "empty", "malformed", "other")
MODEL_KINDS = ("429", "529")
INJECTED = "injected by deja sweep"
_TOOL_LINES = (Kind.TOOL, Kind.OUTCOME)


# ------------------------------------------------------------------------------ rules


@dataclass(frozen=True)
class SweepRule:
    """One ``--perturb`` rule: which steps (``tool`` NAME or ``*``, every ``model`` step,
    or one ``step``) and the perturbations to try at each, as written (``other=FILE``)."""

    select: str  # "tool", "model" or "step"
    value: str | int | None
    perturbations: tuple[str, ...]
    text: str

    @classmethod
    def parse(cls, text: str) -> SweepRule:
        head, sep, rest = text.partition(":")
        head = head.strip()
        names = tuple(p.strip() for p in rest.split(",")) if sep else ()
        if not sep or not all(names):
            raise ConfigError(f"--perturb {text!r}: write SELECTOR:PERTURBATION[,...], e.g. "
                              "tool=search:error,empty, model:429 or step=7:timeout")
        for name in names:
            kind, _, arg = name.partition("=")
            if kind not in (*TOOL_KINDS, *MODEL_KINDS) or (kind == "other") != bool(arg):
                raise ConfigError(
                    f"--perturb {text!r}: unknown perturbation {name!r}; a tool step takes "
                    "error, timeout, empty, malformed or other=FILE, a model step 429 or 529")
        if head == "model":
            return cls("model", None, names, text)
        select, eq, value = head.partition("=")
        if select == "tool" and eq and value and not any(c.isspace() for c in value):
            return cls("tool", value, names, text)
        if select == "step" and eq and value.isdigit():
            return cls("step", int(value), names, text)
        raise ConfigError(f"--perturb {text!r}: the steps are tool=NAME (or tool=*), model, "
                          "or step=N")

    def selects(self, obs: Mapping[str, Any]) -> bool:
        if "within" in obs:  # a call inside a tool's body: fork the tool's own step
            return False
        if self.select == "step":
            return bool(obs["seq"] == self.value)
        if self.select == "model":
            return obs.get("kind") == Kind.MODEL and "response" in obs
        return obs.get("kind") in _TOOL_LINES and self.value in ("*", obs.get("name"))


# ---------------------------------------------------------------------- perturbations


@dataclass(frozen=True)
class Perturbation:
    """One fork of a sweep: at ``step`` (a ``tool`` or ``model`` step, ``step_kind``) of
    ``target`` (the tool's name, or the model's), the perturbation ``kind``; ``document``
    is the step's whole edited document (``deja fork --replace``), ``source`` where an
    ``other`` value came from."""

    step: int
    step_kind: str
    target: str
    kind: str
    document: Any
    source: str | None = None

    @property
    def label(self) -> str:
        return f"{self.kind} ({self.source})" if self.source else self.kind

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "step_kind": self.step_kind, "target": self.target,
                "kind": self.kind, "source": self.source, "document": self.document}


def _empty(value: Any) -> Any:
    return "" if isinstance(value, str) else [] if isinstance(value, (list, tuple)) else \
        {} if isinstance(value, dict) else None


def _malformed(value: Any) -> str:
    """The value's JSON text (a string's own text) cut in half: what a flaky backend that
    cuts its response off mid-way returns, and a string where a structure may be due."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False,
                                                          default=str)
    cut = text[: len(text) // 2]
    return cut if cut != value and cut else '{"truncat'


def _tool_error(kind: str) -> dict[str, Any]:
    if kind == "timeout":
        return {"error": {"type": "TimeoutError", "module": "builtins",
                          "message": f"{INJECTED}: the tool timed out"}}
    return {"error": {"type": "RuntimeError", "module": "builtins", "message": INJECTED}}


def provider_error(obs: Mapping[str, Any], status: int) -> dict[str, Any]:
    """The HTTP response ``obs``'s provider sends for ``status`` (429 or 529): its error
    body's shape, as a document a model step is edited into (:func:`replayer.edit.rebuild`)."""
    name = providers.for_line(obs).name
    limited = status == 429
    message = "Number of requests has exceeded your rate limit" if limited else "Overloaded"
    headers = {"content-type": "application/json", "retry-after": "0",
               "retry-after-ms": "100", "x-should-retry": "true"}
    body: dict[str, Any]
    if name == "openai":
        body = {"error": {"message": message, "type": "requests" if limited else "server_error",
                          "param": None, "code": "rate_limit_exceeded" if limited else None}}
    elif name == "gemini":
        body = {"error": {"code": status, "message": message,
                          "status": "RESOURCE_EXHAUSTED" if limited else "UNAVAILABLE"}}
    elif name == "bedrock":
        kind = "ThrottlingException" if limited else "ServiceUnavailableException"
        headers["x-amzn-errortype"] = kind
        body = {"message": message}
    else:  # the Messages API's shape (Anthropic's, and a format deja does not name)
        body = {"type": "error", "error": {"type": "rate_limit_error" if limited else
                                           "overloaded_error", "message": message},
                "request_id": "req_deja_sweep"}
    return {"status": status, "headers": headers, "body": body}


class _Others:
    """Recordings named by ``other=FILE``, loaded once, each tool's calls in order."""

    def __init__(self, keyring: Keyring) -> None:
        self._keyring = keyring
        self._calls: dict[str, dict[str, list[Mapping[str, Any]]]] = {}

    def document(self, path: str, tool: str, nth: int) -> tuple[dict[str, Any], str]:
        if path not in self._calls:
            try:
                # its answers are signed into each fork: it must verify, as the parent must
                other = load(path, keyring=self._keyring, require_signature=True,
                             allow_incomplete=True)
            except DejaError as exc:
                raise ConfigError(f"other={path}: {exc}") from None
            calls: dict[str, list[Mapping[str, Any]]] = {}
            for obs in other.observations:
                if obs.get("kind") in _TOOL_LINES and "within" not in obs:
                    calls.setdefault(str(obs.get("name")), []).append(obs)
            self._calls[path] = calls
        found = self._calls[path].get(tool)
        if not found:
            raise EditError(f"other={path}: that run never called tool {tool!r}; its tools "
                            f"are: {', '.join(sorted(self._calls[path])) or 'none'}")
        taken = found[min(nth, len(found) - 1)]
        return edit.view(taken), f"{Path(path).name} step {taken['seq']}"


def _tool_document(obs: Mapping[str, Any], kind: str, recorded: Mapping[str, Any],
                   others: _Others, arg: str, nth: int) -> tuple[Any, str | None]:
    if kind in ("error", "timeout"):
        return _tool_error(kind), None
    if kind == "other":
        return others.document(arg, str(obs.get("name")), nth)
    value = recorded.get("result")
    return {"result": _empty(value) if kind == "empty" else _malformed(value)}, None


def _perturb(obs: Mapping[str, Any], name: str, others: _Others,
             nth: int) -> Perturbation:
    """The perturbation ``name`` (``error``, ``other=FILE`` ...) of step ``obs``, checked:
    its document must be one the fork can write and rebuild the step from."""
    kind, _, arg = name.partition("=")
    seq, line_kind = obs["seq"], obs.get("kind")
    if line_kind in _TOOL_LINES and kind in TOOL_KINDS:
        doc, source = _tool_document(obs, kind, edit.view(obs), others, arg, nth)
        step_kind, target = "tool", str(obs.get("name"))
    elif line_kind == Kind.MODEL and kind in MODEL_KINDS and "response" in obs:
        doc, source = provider_error(obs, int(kind)), None
        step_kind, target = "model", str(obs.get("model") or "model")
    else:
        what = ("a model step takes 429 or 529" if line_kind == Kind.MODEL else
                "a tool step takes error, timeout, empty, malformed or other=FILE"
                if line_kind in _TOOL_LINES else "a sweep perturbs tool and model steps")
        raise EditError(f"step {seq} is a {line_kind} step: {what}, not {name!r}")
    try:
        json.dumps(doc, allow_nan=False)
    except (TypeError, ValueError):
        raise EditError(f"step {seq}: the {name} document is not JSON (the recorded value "
                        "is not a JSON value); perturb it with a fork of its own") from None
    edit.rebuild(obs, doc)  # raises EditError for a document the step cannot take
    return Perturbation(seq, step_kind, target, kind, doc, source)


def plan_sweep(cassette: str | Path | Cassette, rules: Iterable[str | SweepRule], *,
               keyring: Keyring | None = None) -> list[Perturbation]:
    """The perturbations ``rules`` make of ``cassette``'s steps, by step, each once.
    A rule that selects no step, a perturbation a step cannot take, a step out of range
    or a bad rule is a :class:`~recorder.errors.UsageError` naming it."""
    ring = keyring or load_keyring(create=False)
    parent = cassette if isinstance(cassette, Cassette) else load(
        cassette, keyring=ring, require_signature=True, allow_incomplete=True)
    parsed = [r if isinstance(r, SweepRule) else SweepRule.parse(r) for r in rules]
    if not parsed:
        raise ConfigError("give at least one --perturb rule, e.g. tool=search:error,empty")
    others, seen, out = _Others(ring), set(), []
    for rule in parsed:
        steps: list[Mapping[str, Any]] = [o for o in parent.observations if rule.selects(o)]
        if rule.select == "step" and not steps:
            n = len(parent.observations)
            raise NoSuchStep(f"--perturb {rule.text!r}: the run has steps 0-{n - 1}, and step "
                             f"{rule.value} is not one a fork can edit")
        if not steps:
            raise ConfigError(f"--perturb {rule.text!r} selects no step; the run's tools are: "
                              f"{', '.join(_tool_names(parent)) or 'none'}")
        for obs in steps:
            nth = _nth_call(parent, obs)
            for name in rule.perturbations:
                p = _perturb(obs, name, others, nth)
                key = (p.step, p.kind, p.source)
                if key not in seen:
                    seen.add(key)
                    out.append(p)
    return sorted(out, key=lambda p: p.step)


def _tool_names(run: Cassette) -> list[str]:
    return sorted({str(o.get("name")) for o in run.observations if o.get("kind") in _TOOL_LINES})


def _nth_call(run: Cassette, obs: Mapping[str, Any]) -> int:
    """Which call of its tool ``obs`` is (0: the first)."""
    return sum(1 for o in run.observations if o["seq"] < obs["seq"] and "within" not in o
               and o.get("kind") in _TOOL_LINES and o.get("name") == obs.get("name"))


# --------------------------------------------------------------------------- outcome


def final_answer(run: Cassette) -> str | None:
    """The text of the reply of ``run``'s last model step that got one (see the module)."""
    for obs in reversed(run.observations):
        response = obs.get("response")
        if obs.get("kind") != Kind.MODEL or "within" in obs or not response or \
                response.get("status", 0) >= 400 or obs.get("api_error") or obs.get("error"):
            continue
        provider = providers.for_line(obs)
        try:
            message = provider.message(response.get("headers", []),
                                       decode_body(response["body"], response.get("encoding")))
        except ValueError:
            continue
        reply = conversation.reply(provider.conversation(run.requests.get(obs["seq"]), message))
        if reply is not None:
            return conversation.text_of(reply)
    return None


@dataclass(frozen=True)
class SweepJob:
    """One fork to run: the perturbation, the files it writes, the ``deja fork`` command
    it is (``fork_argv``) and the job that runs it and reports (``argv``: ``deja sweep
    --job``, whose standard output ends with its record, as a suite's job does)."""

    perturbation: Perturbation
    out: Path  # the fork's cassette
    edit: Path  # its --replace document
    log: Path  # what ``deja fork`` and the program printed
    argv: tuple[str, ...]
    fork_argv: tuple[str, ...]

    @property
    def key(self) -> str:
        return self.out.stem

    def suite_job(self, cwd: str | Path) -> suite.Job:
        """As a job of :mod:`replayer.suite`, run in ``cwd`` (where its paths are; its log
        is named from there too, for a worker that runs in another directory)."""
        return suite.Job(self.key, self.argv, str(cwd), str(Path(cwd) / self.log))

    def to_dict(self) -> dict[str, Any]:
        return {"fork_argv": list(self.fork_argv), "argv": list(self.argv),
                "out": str(self.out), "edit": str(self.edit), "log": str(self.log)}


# ---------------------------------------------------------------------------- running


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()[:40] or "step"


MARK = ".deja-sweep.json"  # in a sweep's directory: its id, the run and cassette it forks


def sweep_mark(out_dir: str | Path) -> dict[str, Any] | None:
    """What the sweep that wrote ``out_dir`` said of itself (its id, the run it forks), or
    None when no sweep did (or the mark cannot be read)."""
    try:
        found = json.loads((Path(out_dir) / MARK).read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def mark_sweep(out_dir: str | Path, sweep_id: str, run: str, cassette: str | Path) -> None:
    """Say in ``out_dir`` which sweep writes it: the same id again resumes it there."""
    Path(out_dir, MARK).write_text(json.dumps(
        {"id": sweep_id, "run": run, "cassette": str(Path(cassette).resolve())}) + "\n")


def plan_jobs(cassette: str | Path, perturbations: Sequence[Perturbation], out_dir: str | Path,
              *, command: Sequence[str] = (), cwd: str | Path | None = None,
              tool_rules: Sequence[str] = (), resume: bool = False) -> list[SweepJob]:
    """One job per perturbation: ``deja fork CASSETTE --at N --replace EDIT -o OUT`` with
    the tool policy's rules (``NAME=RULE``) and ``-- CMD``, run by ``deja sweep --job``;
    its files in ``out_dir`` (``s007-search-error.jsonl``, ``.edit.json``, ``.log``),
    none of which may exist, unless the sweep is ``resume``d there (its jobs then judge
    what an earlier attempt finished and replace what it left unfinished)."""
    out_dir, taken, jobs = Path(out_dir), set(), []
    flags = (*(f"--tool={rule}" for rule in tool_rules),
             *(("--cwd", str(cwd)) if cwd is not None else ()))
    then = ("--", *command) if command else ()
    for p in perturbations:
        stem = f"s{p.step:03d}-{_slug(p.target)}-{p.kind}"
        n = 2
        while stem in taken:
            stem, n = f"s{p.step:03d}-{_slug(p.target)}-{p.kind}-{n}", n + 1
        taken.add(stem)
        out, doc, log = (out_dir / f"{stem}{suffix}" for suffix in (".jsonl", ".edit.json",
                                                                   ".log"))
        for path in () if resume else (out, doc, log):
            if path.exists():
                raise PathTaken(f"{path} already exists; give the sweep another -o directory "
                                "(or the id of the sweep that wrote it: --id)")
        fork = ("deja", "fork", str(cassette), "--at", str(p.step), "--replace", str(doc),
                "-o", str(out), *flags, *then)
        job = ("deja", "sweep", str(cassette), "--job", stem, "--at", str(p.step), "-o",
               str(out_dir), *flags, *then)
        jobs.append(SweepJob(p, out, doc, log, job, fork))
    return jobs


def run_sweep(cassette: str | Path, perturbations: Sequence[Perturbation], *,
              out_dir: str | Path, command: Sequence[str] = (), jobs: int = 1,
              cwd: str | Path | None = None, tool_rules: Sequence[str] = (),
              keyring: Keyring | None = None, runner: suite.Runner | None = None,
              on_done: Callable[[SweepRow], None] | None = None,
              sweep_id: str | None = None, resume: bool = False) -> SweepReport:
    """Run a fork per perturbation (:func:`plan_jobs`), ``jobs`` at a time, each a job of
    :mod:`replayer.suite` (here, or on ``runner``: the durable workers'), whose program
    goes live with its own environment (its base URL, its keys) under the default tool
    policy plus ``tool_rules``; then compare each with the recording. ``on_done`` is
    called with each row as its fork ends. Paths are taken from this directory.
    ``sweep_id`` is written in ``out_dir`` (:func:`mark_sweep`); ``resume``: the sweep of
    that id goes on there (:func:`plan_jobs`)."""
    ring = keyring or load_keyring(create=False)
    parent = load(cassette, keyring=ring, require_signature=True, allow_incomplete=True)
    planned = plan_jobs(cassette, perturbations, out_dir, command=command, cwd=cwd,
                        tool_rules=tool_rules, resume=resume)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    if sweep_id is not None:
        mark_sweep(out_dir, sweep_id, parent.run, cassette)
    for job in planned:
        job.edit.write_text(json.dumps(job.perturbation.document, indent=2,
                                       ensure_ascii=False) + "\n")
    status, answer = run_status(parent), final_answer(parent)
    by_key = {job.key: job for job in planned}
    rows: dict[str, SweepRow] = {}

    def done(record: Mapping[str, Any]) -> None:
        job = by_key.get(str(record.get("incident")))
        if job is not None and job.key not in rows:
            rows[job.key] = record_row(job, record, status, answer, ring)
            if on_done is not None:
                on_done(rows[job.key])

    records = suite.run_jobs([job.suite_job(Path.cwd()) for job in planned], parallel=jobs,
                             runner=runner, on_done=done)
    for job, record in zip(planned, records, strict=True):
        done({**record, "incident": job.key})
    return SweepReport(str(cassette), parent.run, status, answer,
                       tuple(rows[job.key] for job in planned), str(out_dir))


def record_row(job: SweepJob, record: Mapping[str, Any], status: str, answer: str | None,
               keyring: Keyring | None = None) -> SweepRow:
    """The row of a job that ended with ``record`` (``deja sweep --job``'s: the fork's
    exit status; else the suite's error record of a job that did not report)."""
    seconds = float(record.get("seconds") or 0.0)
    worker = record.get("worker") if isinstance(record.get("worker"), str) else None
    if "exit_code" not in record:
        return SweepRow(job.perturbation, str(job.out), None, seconds=seconds, worker=worker,
                        error=f"{record.get('error') or 'the job did not report'} "
                              f"(see {job.log})")
    return replace(job_row(job, record["exit_code"], status, answer, seconds, keyring),
                   worker=worker)


def job_row(job: SweepJob, code: int | None, status: str, answer: str | None,
            seconds: float = 0.0, keyring: Keyring | None = None) -> SweepRow:
    """The row of a fork that ran (exit status ``code``), read back from its cassette."""
    base = SweepRow(job.perturbation, str(job.out), code, seconds=seconds)
    try:
        fork = load(job.out, keyring=keyring, allow_incomplete=True, allow_torn=True)
    except DejaError as exc:
        return _failed(base, job, f"no fork was written ({type(exc).__name__})")
    if fork.end is None:
        return _failed(base, job, "the fork did not end")
    totals = run_totals(fork)
    start = totals["live_from"]
    new_status, new_answer = run_status(fork), final_answer(fork)
    return SweepRow(job.perturbation, str(job.out), code, new_status, new_answer,
                    new_answer != answer, new_status != status, totals["live"] or {},
                    sum(1 for o in fork.observations if o["seq"] >= start and o.get("policy")),
                    seconds)


def _failed(row: SweepRow, job: SweepJob, why: str) -> SweepRow:
    """A fork that could not run: why, with the last line it printed."""
    try:
        said = [line for line in job.log.read_text(errors="replace").splitlines() if line]
    except OSError:
        said = []
    last = f": {said[-1].strip()}" if said else ""
    return SweepRow(row.perturbation, row.cassette, row.exit_code, seconds=row.seconds,
                    error=f"{why}, exit status {row.exit_code}{last} (see {job.log})")
