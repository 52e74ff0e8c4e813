"""A question to a person, and a file the run vouches for: both observations.

``recorder.ask("Pay invoice INV-7 twice?")`` returns a person's answer. The answer is an
effect line, so a replay (or a resume) serves it from the cassette and never asks again.
Live, the run's status record says ``input_required`` with the question, and the answer
comes from whoever runs the program:

- under a ``deja worker`` the program ends at once (exit status 75, no end line: the
  cassette is a resumable prefix) and the worker waits durably; ``deja answer RUN TEXT``
  sends the answer, and the run is resumed with it: everything recorded replays, the
  answer becomes the ``ask`` observation, and the run goes on live;
- otherwise, from the terminal when standard input is one, else from
  ``deja answer RUN TEXT``, which leaves the answer in ``$DEJA_HOME/runs/<run>.answer``
  (read and removed here; a cancel stops the wait).

An answer may hold a secret (a one-time code, a key the agent is to use). Nothing deja
keeps holds it in clear: the ``ask`` line is redacted like any other, and a submitted run's
answer is stored in the runs database, and handed to the engine, redacted
(:func:`seal_answer`); when redaction changed it, the answer as typed waits in
``$DEJA_HOME/runs/<run>.answer`` (mode 0600), which the resumed program reads and removes.
So the program gets what was typed, and a replay or a later resume gets the redacted
answer from the cassette. A worker on another machine than ``deja serve`` finds no such
file: its program gets the redacted answer.

``recorder.artefact("report.csv")`` declares a file the run produced: its path, size and
SHA-256 are an effect line, so a verified cassette vouches for the file's content. A
scheduled run's "verified artefact" is such a file whose hash still matches.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from pathlib import Path
from typing import Any

from recorder.capture import session
from recorder.capture.redact import DEFAULT, REDACTED
from recorder.effects import value
from recorder.errors import Cancelled, ConfigError
from recorder.harness.progress import answer_path, cancel_requested, leave_answer

EXIT_INPUT_REQUIRED = 75  # EX_TEMPFAIL: the run waits for an answer and is resumed with it
ANSWER_ENV = "DEJA_ANSWER"
WORKER_ENV = "DEJA_RUNS_WORKER"


def _progress(current: Any) -> Any:
    return getattr(getattr(current, "guard", None), "progress", None)


def _wait_for_answer(run: str, question: str, poll: float) -> str:
    if sys.stdin is not None and sys.stdin.isatty():
        return input(f"{question} ")
    path = answer_path(run)
    sys.stderr.write(f"deja: run {run} asks: {question}\n"
                     f"deja: answer with: deja answer {run} 'TEXT'\n")
    sys.stderr.flush()
    while True:
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            text = None
        if text is not None:
            path.unlink(missing_ok=True)
            return text
        flag = cancel_requested(run)
        if flag is not None:
            raise Cancelled(f"run {run} was cancelled while waiting for an answer to "
                            f"{question!r}", reason="cancelled", detail=flag)
        time.sleep(poll)


def seal_answer(run: str, text: str) -> str:
    """The form of ``text``, an answer to run ``run``, that deja may store: redacted by the
    built-in rules. When that changed it, ``text`` itself is left for the run's program in
    a private file (see the module docstring)."""
    stored = DEFAULT.text(text)
    if stored != text:
        leave_answer(run, text)
    return stored


def _unsealed(run: Any, given: str) -> str:
    """The answer as typed, when ``given`` is its sealed form and the file is here."""
    if not isinstance(run, str) or REDACTED not in given:
        return given
    path = answer_path(run)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return given
    if DEFAULT.text(text) != given:  # another answer's: not this one
        return given
    path.unlink(missing_ok=True)
    return text


def _live_answer(question: str, current: Any, poll: float) -> str:
    run = getattr(current, "run_id", None)
    given = os.environ.pop(ANSWER_ENV, None)  # the worker's answer, for one question
    if given is not None:
        return _unsealed(run, given)
    if run is None:
        return input(f"{question} ")
    progress = _progress(current)
    if progress is not None:
        progress.update(status="input_required", question=question,
                        step=f"waiting for an answer: {question}", force=True)
    if os.environ.get(WORKER_ENV) == "1":
        writer = getattr(current, "writer", None)
        if writer is not None:  # a resumable prefix: forced to disk, no end line
            writer.abandon()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_INPUT_REQUIRED)
    answer = _wait_for_answer(run, question, poll)
    if progress is not None:
        progress.update(status="running", question=None, step="answered", force=True)
    return answer


def ask(question: str, *, poll: float = 0.2) -> str:
    """A person's answer to ``question``: live once, then from the cassette."""
    if not isinstance(question, str) or not question.strip():
        raise ConfigError("recorder.ask() needs a question (a non-empty string)")
    current = session.active()
    return str(value("ask", lambda: _live_answer(question, current, poll)))


def artefact(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Declare ``path`` an artefact of the run: its size and SHA-256 are observed."""
    given = Path(path)

    def describe() -> dict[str, Any]:
        try:
            data = given.read_bytes()
        except OSError as exc:
            raise ConfigError(f"recorder.artefact({str(path)!r}): cannot read it "
                              f"({exc.strerror or exc})") from None
        return {"path": str(path), "bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest()}

    info = value("artefact", describe)
    return dict(info)
