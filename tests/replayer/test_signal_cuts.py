"""A stop signal to ``deja record`` at the worst moments, through the real CLI and processes.

- **A response cut by the signal is not logged.** SIGTERM arrives while the agent reads a
  streamed reply: in the read itself (the stub sends its events seconds apart), or while
  the agent handles an event, so that the stream is closed on the way out. The run ends
  ``interrupted`` with the first, whole call as its only step (no error line with an empty
  body, no 200 with half a body); ``deja resume`` asks the cut call again live and
  completes the run, whose two steps hold whole bodies; ``deja replay`` of it is identical.
- **A program stopped on its way out, its work done,** ends resumable: ``interrupted``, not
  ``error`` (its last statement is asleep; or it catches the stop and exits 130 itself), and
  ``deja resume`` completes it with the stub server gone: every step is replayed, none goes
  out. A program whose work is done and which is stopped inside an ``atexit`` handler
  (exit status 0) ends ``completed`` with exit code 0, and replays offline.

Every wait polls the agent's unbuffered output with a deadline; a process still running
when a test ends is killed. The stub cannot hold a JSON body back once its headers are sent
(``delay_ms`` delays the whole answer), so a non-streamed body is not cut here.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from recorder.cassette import Cassette, load
from recorder.testing.server import StubServer

ROOT = Path(__file__).resolve().parents[2]
KEY = "test-key-0123456789abcdef"  # conftest's DEJA_KEY, given explicitly to subprocesses
MODEL = "claude-sonnet-4-6"
TIMEOUT = 30.0
HOLD = "30"  # seconds an agent waits for the signal (it comes at once)
SIGTERMED = 128 + signal.SIGTERM

# The agents wait in short sleeps, as an agent waiting on something polls: a signal that
# lands after the interpreter last looked for one and before a sleep starts is acted on at
# the next step. One long sleep would hold it until the sleep ends (CPython runs a handler
# between bytecodes; a sleep is woken only by a signal that lands inside it).
DWELL = """\
def dwell(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.02)
"""

# Two streamed calls, every event printed. Under AGENT_HOLD the agent dwells on each event
# of the second call (only the recording has it: a resume or a replay runs straight on).
STREAM_AGENT = '''\
import os
import time

import anthropic

HOLD = float(os.environ.get("AGENT_HOLD", "0"))
client = anthropic.Anthropic(max_retries=0)
messages = [{"role": "user", "content": "count to three"}]


%(dwell)s

def ask(n):
    params = {"model": "%(model)s", "max_tokens": 64, "messages": messages}
    text = ""
    if "%(api)s" == "stream":
        with client.messages.stream(**params) as stream:
            for event in stream:
                print(f"event {n} {event.type}")
                dwell(HOLD if n == 2 else 0)
            text = stream.get_final_message().content[0].text
    else:
        with client.messages.create(stream=True, **params) as stream:
            for event in stream:
                print(f"event {n} {event.type}")
                dwell(HOLD if n == 2 else 0)
                if event.type == "content_block_delta":
                    text += event.delta.text
    return text


for n in (1, 2):
    print(f"call {n}")
    text = ask(n)
    print(f"reply {n} {text}")
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "go on"}]
print("done")
'''

# Two JSON calls (plain httpx: it starts faster than the SDK), then "done"; under AGENT_HOLD
# it lingers on its way out, as EXIT says.
EXIT_AGENT = '''\
import atexit
import os
import sys
import time

import httpx

HOLD = float(os.environ.get("AGENT_HOLD", "0"))
URL = os.environ["ANTHROPIC_BASE_URL"] + "/v1/messages"
HEADERS = {"x-api-key": os.environ["ANTHROPIC_API_KEY"], "anthropic-version": "2023-06-01"}


%(dwell)s

def work():
    messages = [{"role": "user", "content": "count to three"}]
    with httpx.Client(headers=HEADERS) as client:
        for n in (1, 2):
            body = {"model": "%(model)s", "max_tokens": 64, "messages": messages}
            reply = client.post(URL, json=body).raise_for_status().json()
            text = reply["content"][0]["text"]
            print(f"reply {n} {text}")
            messages += [{"role": "assistant", "content": text},
                         {"role": "user", "content": "go on"}]


def linger():
    print("done")
    dwell(HOLD)


if "%(exit)s" == "sleeps":
    work()
    linger()
elif "%(exit)s" == "catches":
    try:
        work()
        linger()
    except KeyboardInterrupt:
        print("stopped")
        sys.exit(130)
else:
    work()
    atexit.register(linger)
'''


def agent(template: str, **values: str) -> str:
    return template % {"model": MODEL, "dwell": DWELL, **values}


class Deja:
    """``python -m deja ARGS`` as a real process; its standard output read line by line."""

    def __init__(self, *args: str, env: dict[str, str], cwd: Path) -> None:
        self.stderr_path = cwd / f"stderr-{time.monotonic_ns()}.txt"
        with self.stderr_path.open("w") as err:
            self.process = subprocess.Popen([sys.executable, "-m", "deja", *args], env=env,
                                            cwd=cwd, stdout=subprocess.PIPE, stderr=err,
                                            text=True)
        self.out: list[str] = []
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def wait_for(self, wanted: str) -> None:
        """Read the output until the line ``wanted``; fail if it does not come in time."""
        deadline = time.monotonic() + TIMEOUT
        while True:
            try:
                line = self._lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise AssertionError(f"no line {wanted!r} within {TIMEOUT} s; the program "
                                     f"printed {self.out}\n{self.stderr}") from None
            if line is None:
                self._lines.put(None)
                raise AssertionError(f"the program ended without printing {wanted!r}; it "
                                     f"printed {self.out}\n{self.stderr}")
            self.out.append(line)
            if line == wanted:
                return

    def finish(self) -> int:
        """Wait for the process to end; all it printed is in ``out``; its status."""
        try:
            code = self.process.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=TIMEOUT)
            raise AssertionError(f"still running after {TIMEOUT} s; it printed {self.out}"
                                 f"\n{self.stderr}") from None
        self._reader.join(timeout=TIMEOUT)
        while (line := self._lines.get_nowait()) is not None:
            self.out.append(line)
        return code


@pytest.fixture
def run_deja(tmp_path: Path) -> Iterator[Any]:
    """``run_deja(*args, env=...)`` starts a ``Deja`` in ``tmp_path``; those still running
    when the test ends are killed."""
    started: list[Deja] = []

    def start(*args: str, env: dict[str, str]) -> Deja:
        started.append(Deja(*args, env=env, cwd=tmp_path))
        return started[-1]

    yield start
    for p in started:
        if p.process.poll() is None:
            p.process.kill()
            p.process.wait(timeout=TIMEOUT)
        if p.process.stdout is not None:
            p.process.stdout.close()


def agent_env(server: StubServer) -> dict[str, str]:
    return {**os.environ, "ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_API_KEY": "sk-test",
            "DEJA_KEY": KEY}


def kinds(c: Cassette) -> list[str]:
    return [o["kind"] for o in c.observations]


def whole(step: Mapping[str, Any], text: str, *, stream: bool) -> None:
    """A model step that holds the model's whole answer ``text`` and no error."""
    assert "error" not in step, step["error"]
    response = step["response"]
    assert response["status"] == 200
    body = response["body"]
    if stream:
        assert body.rstrip().endswith('data: {"type":"message_stop"}'), body
        assert json.dumps(text)[1:-1] in body
    else:
        assert json.loads(body)["content"][0]["text"] == text


def replayed(c: Cassette) -> int:
    [event] = [o for o in c.observations if o["kind"] == "control"]
    assert event["event"] == "resumed"
    assert event["detail"] is not None
    return int(event["detail"]["replayed"])


def replay_matches(cassette: Path, resumed: list[str], run_deja: Any,
                   env: dict[str, str]) -> None:
    """``deja replay`` runs the program offline to the end, printing what it printed, and
    finds the run identical."""
    replay = run_deja("replay", str(cassette), env=env)
    assert replay.finish() == 0, replay.stderr
    program, report = replay.out[:len(resumed)], replay.out[len(resumed):]
    assert program == resumed
    assert report[0].endswith(": identical"), report


# --------------------------------------------------------------------------- cut responses


@pytest.mark.parametrize(("where", "api"), [("read", "stream"), ("handling", "create")],
                         ids=["in-the-read", "while-handling-an-event"])
def test_a_stream_cut_by_sigterm_is_not_logged_and_the_resume_asks_again(
        tmp_path: Path, run_deja: Any, where: str, api: str) -> None:
    (tmp_path / "agent.py").write_text(agent(STREAM_AGENT, api=api))
    cut: dict[str, Any] = {"text": "four five six"}
    if where == "read":
        cut["event_delay_ms"] = 3000  # the next event is seconds away: the SDK waits in a read
    script = {"model": MODEL, "turns": [{"text": "one two three"}, cut,
                                        {"text": "four five six"}]}  # the resume's live call
    cassette = tmp_path / "run.jsonl"
    with StubServer(script) as server:
        env = agent_env(server)
        record_env = {**env, "AGENT_HOLD": HOLD} if where == "handling" else env
        record = run_deja("record", "-o", str(cassette), "--", "python", "-u", "agent.py",
                          env=record_env)
        record.wait_for("event 2 message_start")
        record.process.send_signal(signal.SIGTERM)
        assert record.finish() == SIGTERMED, record.stderr
        assert "reply 2" not in "\n".join(record.out)
        assert len(server.requests) == 2

        crashed = load(cassette, allow_incomplete=False)
        assert crashed.end is not None and crashed.end["status"] == "interrupted", crashed.end
        assert crashed.end["exit_code"] == SIGTERMED, crashed.end
        assert kinds(crashed) == ["model"]  # the cut call left no line at all
        whole(crashed.observations[0], "one two three", stream=True)

        resume = run_deja("resume", str(cassette), env=env)
        assert resume.finish() == 0, resume.stderr
        assert len(server.requests) == 3  # the cut call, asked again
        final = load(cassette, allow_incomplete=False)
        assert final.end is not None and final.end["status"] == "completed", final.end
        assert final.end["exit_code"] == 0
        assert kinds(final) == ["model", "control", "model"]
        assert replayed(final) == 1
        first, second = (o for o in final.observations if o["kind"] == "model")
        whole(first, "one two three", stream=True)
        whole(second, "four five six", stream=True)
        assert resume.out[-3:] == ["event 2 message_stop", "reply 2 four five six", "done"]
        assert resume.out.count("event 2 message_start") == 1  # the SDK did not retry

    replay_matches(cassette, resume.out, run_deja, env)


# --------------------------------------------------------------------------- on the way out


@pytest.mark.parametrize("exit_how", ["sleeps", "catches"])
def test_a_program_stopped_on_its_way_out_ends_interrupted_and_resumes_offline(
        tmp_path: Path, run_deja: Any, exit_how: str) -> None:
    (tmp_path / "agent.py").write_text(agent(EXIT_AGENT, exit=exit_how))
    script = {"model": MODEL, "turns": [{"text": "one two three"}, {"text": "four five six"}]}
    cassette = tmp_path / "run.jsonl"
    with StubServer(script) as server:
        env = agent_env(server)
        record = run_deja("record", "-o", str(cassette), "--", "python", "-u", "agent.py",
                          env={**env, "AGENT_HOLD": HOLD})
        record.wait_for("done")
        record.process.send_signal(signal.SIGTERM)
        assert record.finish() == SIGTERMED, record.stderr
        assert len(server.requests) == 2
    # the stub is gone: a live call would now fail (connection refused) and the run with it

    stopped = load(cassette, allow_incomplete=False)
    assert stopped.end is not None and stopped.end["status"] == "interrupted", stopped.end
    assert stopped.end["exit_code"] == SIGTERMED, stopped.end
    assert kinds(stopped) == ["model", "model"]

    resume = run_deja("resume", str(cassette), env=env)
    assert resume.finish() == 0, resume.stderr
    final = load(cassette, allow_incomplete=False)
    assert final.end is not None and final.end["status"] == "completed", final.end
    assert final.end["exit_code"] == 0
    assert kinds(final) == ["model", "model", "control"]  # nothing live after the resume
    assert replayed(final) == 2
    for step, text in zip(final.observations[:2], ("one two three", "four five six"),
                          strict=True):
        whole(step, text, stream=False)
    assert resume.out == ["reply 1 one two three", "reply 2 four five six", "done"]


def test_a_program_stopped_in_its_atexit_handler_with_status_0_ends_completed(
        tmp_path: Path, run_deja: Any) -> None:
    (tmp_path / "agent.py").write_text(agent(EXIT_AGENT, exit="atexit"))
    script = {"model": MODEL, "turns": [{"text": "one two three"}, {"text": "four five six"}]}
    cassette = tmp_path / "run.jsonl"
    with StubServer(script) as server:
        env = agent_env(server)
        record = run_deja("record", "-o", str(cassette), "--", "python", "-u", "agent.py",
                          env={**env, "AGENT_HOLD": HOLD})
        record.wait_for("done")
        record.process.send_signal(signal.SIGTERM)
        assert record.finish() == SIGTERMED, record.stderr

    ended = load(cassette, allow_incomplete=False)
    assert ended.end is not None, ended
    assert (ended.end["status"], ended.end["exit_code"]) == ("completed", 0), ended.end
    assert kinds(ended) == ["model", "model"]
    replay_matches(cassette, record.out, run_deja, env)  # offline: the stub is gone
