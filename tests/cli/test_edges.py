"""Edges of the launcher and the cassette file, through the real CLI and real processes.

- ``deja fork`` and ``deja resume`` given a relative cassette path from another directory
  (the program runs in the recorded one): the writer lock handed to the program names the
  same file, so the command is not refused by its own lock;
- a signal to the program alone (not to ``deja record``): the run ends ``interrupted`` and
  ``deja record`` exits 128 + N, as it does for a signal passed on;
- a signal while the program's interpreter starts, during deja's bootstrap or before it:
  no "Fatal Python error", the run ends ``interrupted`` with its end line (its status
  record says so), exit 128 + N, and it resumes;
- junk after the last line (what a power loss leaves): ``deja verify`` names ``deja
  repair``, which cuts it after a dry run, keeping a copy; edited lines are not junk;
- ``deja import`` of a "billion laughs" YAML is refused; an anchor vcrpy writes is not.

The agents run against the stub model server; every wait polls with a deadline.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from recorder.cassette import load
from recorder.testing.server import StubServer

KEY = "test-key-0123456789abcdef"  # conftest's DEJA_KEY, given explicitly to subprocesses
TIMEOUT = 120.0

AGENT = '''\
import os
import time

import anthropic
import recorder


@recorder.tool
def search(query: str) -> str:
    return "results for " + query


client = anthropic.Anthropic(max_retries=0)
reply = client.messages.create(model="claude-sonnet-4-6", max_tokens=32,
                               messages=[{"role": "user", "content": "hi"}])
print("answered", flush=True)
if os.environ.get("AGENT_HOLD"):  # the recording waits here for its signal
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        time.sleep(0.02)
print(reply.content[0].text, search("session"), flush=True)

if os.environ.get("AGENT_KILLED_AT_EXIT"):
    # The out-of-memory killer picks the program as it exits, once deja's bootstrap has
    # handed over the run's end line: SIGKILL while the interpreter tears its modules down.
    import json

    report = json.loads(dict(item.split("=", 1) for item in open("/proc/self/environ").read()
                             .split("\\0") if "=" in item)["DEJA_LAUNCH"])["report"]

    class KilledAtExit:
        def __del__(self) -> None:
            if os.path.exists(report):
                os.kill(os.getpid(), 9)

    killed_at_exit = KilledAtExit()
'''

# Run by deja's bootstrap (it chains the sitecustomize it shadows) while the session
# starts: it says so and waits for the test to have sent its signal.
BOOTING = '''\
import os
import sys
import time

if "deja.boot" in sys.modules:  # in the recorded program, not in deja's own process
    open(os.environ["BOOT_MARK"], "w").close()
    deadline = time.monotonic() + 30
    while not os.path.exists(os.environ["BOOT_GO"]) and time.monotonic() < deadline:
        time.sleep(0.01)
'''


@pytest.fixture
def project(tmp_path: Path) -> Path:
    root = tmp_path / "project"
    (root / "sub").mkdir(parents=True)
    (root / "agent.py").write_text(AGENT)
    return root


@pytest.fixture
def env(tmp_path: Path, deja_home: Path) -> Iterator[dict[str, str]]:
    with StubServer({"default": {"text": "ok"}}) as server:
        yield {**os.environ, "DEJA_HOME": str(deja_home), "DEJA_KEY": KEY,
               "ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_API_KEY": "sk-test",
               "PYTHONUNBUFFERED": "1"}


def deja(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "deja", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=180)


class Launched:
    """``deja ARGS`` running, its output read line by line as it comes."""

    def __init__(self, args: list[str], env: dict[str, str], cwd: Path) -> None:
        self.process = subprocess.Popen([sys.executable, "-m", "deja", *args], env=env,
                                        cwd=cwd, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.err: list[str] = []
        self.readers = [threading.Thread(target=self._read, args=(stream, put), daemon=True)
                        for stream, put in ((self.process.stdout, self.lines.put),
                                            (self.process.stderr, self.err.append))]
        for reader in self.readers:
            reader.start()

    @staticmethod
    def _read(stream, put: Callable[[str], None]) -> None:
        with stream:
            for line in stream:
                put(line)

    def wait_line(self, text: str) -> None:
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                if text in self.lines.get(timeout=0.1):
                    return
            assert self.process.poll() is None, "".join(self.err)
        raise AssertionError(f"no line {text!r} within {TIMEOUT}s")

    def program(self) -> int:
        """The pid of the program deja launched (its only child)."""
        return wait_for(lambda: _child_of(self.process.pid), "the program's process")

    def finish(self) -> tuple[int, str]:
        try:
            code = self.process.wait(timeout=TIMEOUT)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
            for reader in self.readers:
                reader.join(timeout=TIMEOUT)
        return code, "".join(self.err)


@pytest.fixture
def launch() -> Iterator[Callable[[list[str], dict[str, str], Path], Launched]]:
    """Start ``deja ARGS`` (see :class:`Launched`); whatever still runs at the end is
    killed."""
    started: list[Launched] = []

    def start(args: list[str], env: dict[str, str], cwd: Path) -> Launched:
        started.append(Launched(args, env, cwd))
        return started[-1]

    yield start
    for run in started:
        if run.process.poll() is None:
            run.process.kill()
        run.finish()


Launch = Callable[[list[str], dict[str, str], Path], Launched]


def _child_of(pid: int) -> int | None:
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return None
    return int(children[0]) if children else None


def wait_for(probe: Callable[[], object], what: str) -> object:
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        found = probe()
        if found:
            return found
        time.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


def end_of(path: Path) -> dict:
    return json.loads(path.read_bytes().rstrip(b"\n").rsplit(b"\n", 1)[-1])


def status_record(deja_home: Path, cassette: Path) -> dict:
    run = json.loads(cassette.read_bytes().split(b"\n", 1)[0])["run"]
    return json.loads((deja_home / "runs" / f"{run}.json").read_text())


def recorded(project: Path, env: dict[str, str], name: str = "run.jsonl") -> Path:
    done = deja("record", "-o", f"cassettes/{name}", "--", "python", "agent.py", env=env,
                cwd=project)
    assert done.returncode == 0, done.stderr
    return project / "cassettes" / name


@pytest.fixture(scope="module")
def completed_run(tmp_path_factory: pytest.TempPathFactory, module_env: dict[str, str]) -> Path:
    """A completed run of AGENT, recorded once for the module (see :func:`checked_out`)."""
    root = tmp_path_factory.mktemp("edges") / "project"
    root.mkdir()
    (root / "agent.py").write_text(AGENT)
    with StubServer({"default": {"text": "ok"}}) as server:
        return recorded(root, {**module_env, "ANTHROPIC_BASE_URL": server.url,
                               "ANTHROPIC_API_KEY": "sk-test", "PYTHONUNBUFFERED": "1"})


def checked_out(project: Path, completed_run: Path) -> Path:
    """The completed run, in ``project`` where :func:`recorded` would have recorded it."""
    (project / "cassettes").mkdir(exist_ok=True)
    return Path(shutil.copyfile(completed_run, project / "cassettes" / "run.jsonl"))


def interrupted(project: Path, env: dict[str, str], name: str, launch: Launch) -> Path:
    """A run stopped by SIGTERM to ``deja record`` after its first call."""
    run = launch(["record", "-o", f"cassettes/{name}", "--", "python", "agent.py"],
                   {**env, "AGENT_HOLD": "1"}, project)
    run.wait_line("answered")
    run.process.send_signal(signal.SIGTERM)
    code, err = run.finish()
    assert code == 128 + signal.SIGTERM, err
    return project / "cassettes" / name


# ------------------------------------------------------------------ a relative path


def test_fork_and_resume_take_a_relative_path_from_another_directory(
        project: Path, env: dict[str, str], completed_run: Path, launch: Launch) -> None:
    checked_out(project, completed_run)
    forked = deja("fork", "../cassettes/run.jsonl", "--at", "1", "--set", 'result="edited"',
                  "-o", "../cassettes/fork.jsonl", env=env, cwd=project / "sub")
    assert forked.returncode == 0, forked.stderr
    assert "CassetteLocked" not in forked.stderr
    assert "ok edited" in forked.stdout  # the program ran in the recorded directory
    fork = load(project / "cassettes" / "fork.jsonl", allow_incomplete=False)
    assert fork.end is not None and fork.end["status"] == "completed"

    interrupted(project, env, "stopped.jsonl", launch)
    resumed = deja("resume", "../cassettes/stopped.jsonl", env=env, cwd=project / "sub")
    assert resumed.returncode == 0, resumed.stderr
    assert "end status completed" in resumed.stderr
    whole = load(project / "cassettes" / "stopped.jsonl", allow_incomplete=False)
    assert whole.end is not None and whole.end["status"] == "completed"


# ------------------------------------------------------------------ signals


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_program_alone_exits_128_plus_n(
        project: Path, env: dict[str, str], deja_home: Path, launch: Launch,
        signum: int) -> None:
    run = launch(["record", "-o", "cassettes/run.jsonl", "--", "python", "agent.py"],
                   {**env, "AGENT_HOLD": "1"}, project)
    run.wait_line("answered")
    os.kill(run.program(), signum)  # not to deja record: it passes nothing on
    code, err = run.finish()
    assert code == 128 + signum, err
    cassette = project / "cassettes" / "run.jsonl"
    end = end_of(cassette)
    assert (end["kind"], end["status"], end["exit_code"]) == ("end", "interrupted", 128 + signum)
    assert status_record(deja_home, cassette)["status"] == "interrupted"


def test_a_program_killed_as_it_exits_is_resumable_not_failed(
        project: Path, env: dict[str, str], deja_home: Path) -> None:
    """Every step logged, then SIGKILL on the way out (sent to the program alone): the run
    is interrupted, which a worker retries, and a resume closes it completed."""
    done = deja("record", "-o", "cassettes/run.jsonl", "--", "python", "agent.py",
                env={**env, "AGENT_KILLED_AT_EXIT": "1"}, cwd=project)
    assert done.returncode == 128 + signal.SIGKILL, done.stderr
    assert "ok results for session" in done.stdout
    cassette = project / "cassettes" / "run.jsonl"
    end = end_of(cassette)
    assert (end["kind"], end["status"], end["exit_code"]) == \
        ("end", "interrupted", 128 + signal.SIGKILL)
    assert end["reason"] == "signal 9 as the program exited"
    assert status_record(deja_home, cassette)["status"] == "interrupted"
    resumed = deja("resume", "cassettes/run.jsonl", env=env, cwd=project)
    assert resumed.returncode == 0, resumed.stderr
    assert load(cassette, allow_incomplete=False).end["status"] == "completed"


@pytest.mark.parametrize("command", [["python", "missing.py"], ["no-such-program-here"],
                                     ["python", "-m", "no_such_module_here"]],
                         ids=["script", "program", "module"])
def test_a_program_that_cannot_start_is_not_recorded(
        project: Path, env: dict[str, str], command: list[str]) -> None:
    done = deja("record", "-o", "cassettes/run.jsonl", "--", *command, env=env, cwd=project)
    assert done.returncode == 2, done.stderr
    assert "cannot start in" in done.stderr and "Nothing was recorded" in done.stderr
    assert "recorded run" not in done.stderr and "Traceback" not in done.stderr
    assert not (project / "cassettes").exists()


def test_a_harness_stop_the_program_does_not_catch_is_one_line(
        project: Path, env: dict[str, str]) -> None:
    """A budget stops the run inside the SDK's call: deja's message, not fifty lines of
    SDK frames, in the program's output (and so in a worker's log)."""
    (project / "twice.py").write_text(
        "import anthropic\n"
        "client = anthropic.Anthropic(max_retries=0)\n"
        "for _ in range(2):\n"
        "    client.messages.create(model='claude-sonnet-4-6', max_tokens=32,\n"
        "                           messages=[{'role': 'user', 'content': 'hi'}])\n")
    done = deja("record", "--max-turns", "1", "-o", "cassettes/run.jsonl", "--", "python",
                "twice.py", env=env, cwd=project)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert "deja: BudgetExhausted: " in done.stderr and "turns budget exhausted" in \
        done.stderr, done.stderr
    assert end_of(project / "cassettes" / "run.jsonl")["status"] == "exhausted"


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_while_the_bootstrap_runs_ends_the_run_interrupted(
        project: Path, env: dict[str, str], deja_home: Path, tmp_path: Path,
        launch: Launch, signum: int) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BOOTING)
    mark, go = tmp_path / "booting", tmp_path / "go"
    run = launch(["record", "-o", "cassettes/run.jsonl", "--", "python", "agent.py"],
                   {**env, "PYTHONPATH": os.pathsep.join(filter(None, [
                       str(site), env.get("PYTHONPATH")])),
                    "BOOT_MARK": str(mark), "BOOT_GO": str(go)}, project)
    wait_for(mark.exists, "the bootstrap to start the session")
    os.kill(run.program(), signum)
    go.touch()
    code, err = run.finish()
    assert "Fatal Python error" not in err and "Traceback" not in err, err
    assert code == 128 + signum, err
    cassette = project / "cassettes" / "run.jsonl"
    end = end_of(cassette)
    assert (end["kind"], end["status"], end["exit_code"]) == ("end", "interrupted", 128 + signum)
    assert not run.lines.qsize(), "the program ran after the signal"
    assert status_record(deja_home, cassette)["status"] == "interrupted"
    resumed = deja("resume", "cassettes/run.jsonl", env=env, cwd=project)
    assert resumed.returncode == 0, resumed.stderr
    assert load(cassette, allow_incomplete=False).end["status"] == "completed"


def test_a_signal_as_the_interpreter_starts_ends_the_run_interrupted(
        project: Path, env: dict[str, str], launch: Launch) -> None:
    """Ctrl-C lands before deja's bootstrap could take it (sent the moment the program's
    process exists): held until the session has started, then the run ends."""
    run = launch(["record", "-o", "cassettes/run.jsonl", "--", "python", "agent.py"],
                   env, project)
    os.kill(run.program(), signal.SIGINT)
    code, err = run.finish()
    assert "Fatal Python error" not in err and "Traceback" not in err, err
    assert code == 128 + signal.SIGINT, err
    end = end_of(project / "cassettes" / "run.jsonl")
    assert (end["kind"], end["status"]) == ("end", "interrupted")


# ------------------------------------------------------------------ junk after the end


@pytest.mark.parametrize("junk", [b"\0" * 4096, b"\0\0\0\n\0\0\0\0", b"{}\n",
                                  b'{"seq":3,"kind":"mo'],
                         ids=["zeros", "zeros-with-a-newline", "an-object", "a-fragment"])
def test_repair_cuts_junk_after_the_end_line(project: Path, env: dict[str, str],
                                             completed_run: Path, junk: bytes) -> None:
    cassette = checked_out(project, completed_run)
    whole = cassette.read_bytes()
    cassette.write_bytes(whole + junk)

    verify = deja("verify", str(cassette), env=env, cwd=project)
    assert verify.returncode == 2
    assert f"deja repair {cassette}" in verify.stderr and "after the end line" in verify.stderr
    resume = deja("resume", str(cassette), env=env, cwd=project)  # the run has ended
    assert resume.returncode == 2
    assert "NotResumable" in resume.stderr or f"deja repair {cassette}" in resume.stderr

    dry = deja("repair", "--dry-run", str(cassette), env=env, cwd=project)
    assert dry.returncode == 0, dry.stderr
    assert f"would cut: {cassette}: {len(junk)} bytes after seq" in dry.stdout
    assert "the run ended completed" in dry.stdout
    assert cassette.read_bytes() == whole + junk  # a dry run writes nothing
    assert not cassette.with_name("run.jsonl.bak").exists()

    fixed = deja("repair", str(cassette), env=env, cwd=project)
    assert fixed.returncode == 0, fixed.stderr
    assert cassette.read_bytes() == whole
    assert cassette.with_name("run.jsonl.bak").read_bytes() == whole + junk
    assert deja("verify", str(cassette), env=env, cwd=project).returncode == 0
    again = deja("repair", str(cassette), env=env, cwd=project)
    assert again.returncode == 0 and "nothing to cut" in again.stdout


def test_repair_then_resume_a_crashed_run_with_junk(project: Path, env: dict[str, str],
                                                    completed_run: Path) -> None:
    cassette = checked_out(project, completed_run)
    cut = load(cassette).end_offset
    assert cut is not None
    cassette.write_bytes(cassette.read_bytes()[:cut] + b"\0" * 100 + b"\n" + b"\0" * 20)
    resume = deja("resume", str(cassette), env=env, cwd=project)
    assert resume.returncode == 2
    assert f"deja repair {cassette}" in resume.stderr and "deja resume" in resume.stderr
    fixed = deja("repair", str(cassette), env=env, cwd=project)
    assert fixed.returncode == 0, fixed.stderr
    assert "the run has no end line" in fixed.stdout
    resumed = deja("resume", str(cassette), env=env, cwd=project)
    assert resumed.returncode == 0, resumed.stderr
    assert load(cassette, allow_incomplete=False).end["status"] == "completed"


def test_repair_refuses_edited_lines(project: Path, env: dict[str, str],
                                     completed_run: Path) -> None:
    cassette = checked_out(project, completed_run)
    lines = cassette.read_bytes().splitlines(keepends=True)
    for name, data in (("a line twice", b"".join([*lines, lines[1], b"\0\0"])),
                       ("an edited line", b"".join(
                           [lines[0], lines[1].replace(b'"seq":0', b'"seq":0 '), *lines[2:],
                            b"junk"]))):
        cassette.write_bytes(data)
        refused = deja("repair", str(cassette), env=env, cwd=project)
        assert refused.returncode == 2, name
        assert "NotRepairable" in refused.stderr and "nothing was written" in refused.stderr
        assert cassette.read_bytes() == data, name
        assert not cassette.with_name("run.jsonl.bak").exists(), name


def test_repair_needs_the_key(project: Path, env: dict[str, str], completed_run: Path) -> None:
    cassette = checked_out(project, completed_run)
    cassette.write_bytes(cassette.read_bytes() + b"\0\0")
    refused = deja("repair", str(cassette), env={**env, "DEJA_KEY": "another-key-0123456789"},
                   cwd=project)
    assert refused.returncode == 2 and "UnverifiedCassette" in refused.stderr


# ------------------------------------------------------------------ YAML aliases


def _vcr_yaml(headers: str, more: str = "") -> str:
    body = ('{"model":"claude-sonnet-4-6","max_tokens":8,'
            '"messages":[{"role":"user","content":"hi"}]}')
    answer = ('{"id":"msg_1","type":"message","role":"assistant","model":"claude-sonnet-4-6",'
              '"content":[{"type":"text","text":"ok"}],"stop_reason":"end_turn",'
              '"usage":{"input_tokens":1,"output_tokens":1}}')
    return (f"{more}version: 1\ninteractions:\n"
            f"- request:\n    method: POST\n    uri: https://api.anthropic.com/v1/messages\n"
            f"    body: '{body}'\n    headers: {headers}\n"
            f"  response:\n    status: {{code: 200, message: OK}}\n"
            f"    headers: {{content-type: [application/json]}}\n"
            f"    body: {{string: '{answer}'}}\n")


def test_import_refuses_a_billion_laughs(tmp_path: Path, env: dict[str, str]) -> None:
    laughs = 'l0: &l0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + "".join(
        f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]\n" for i in range(1, 6))
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(_vcr_yaml("{x-laughs: *l5}", laughs))
    assert bomb.stat().st_size < 1024  # 9^5 laughs: 4 MB once written out
    out = tmp_path / "out.jsonl"
    refused = deja("import", str(bomb), "-o", str(out), env=env, cwd=tmp_path)
    assert refused.returncode == 2
    assert "YamlExpansion" in refused.stderr and "billion" in refused.stderr
    assert not out.exists()

    shared = tmp_path / "shared.yaml"  # an anchor as vcrpy's dumper writes one: imported
    shared.write_text(_vcr_yaml("*h", "common: &h {content-type: [application/json]}\n"))
    imported = deja("import", str(shared), "-o", str(out), env=env, cwd=tmp_path)
    assert imported.returncode == 0, imported.stderr
    assert load(out, allow_incomplete=False).observations[0]["kind"] == "model"


# ------------------------------------------------------------------ --json, also on errors


def test_verify_json_and_json_errors_on_stdout(project: Path, env: dict[str, str],
                                               completed_run: Path) -> None:
    cassette = checked_out(project, completed_run)
    ok = deja("verify", "--json", str(cassette), env=env, cwd=project)
    assert ok.returncode == 0, ok.stderr
    said = json.loads(ok.stdout)
    assert said["ok"] is True and said["status"] == "completed" and said["verified"] is True
    assert said["steps"] == len(load(cassette).observations) and said["end_line"] is True

    lines = cassette.read_bytes().split(b"\n")
    lines[1] = lines[1].replace(b'"seq":0', b'"seq":0 ')  # an edit the chain catches
    cassette.write_bytes(b"\n".join(lines))
    for args in (["verify", "--json", str(cassette)], ["replay", "--json", str(cassette)],
                 ["show", "--json", str(cassette)],
                 ["replay", "--json", str(project / "cassettes" / "missing.jsonl")]):
        done = deja(*args, env=env, cwd=project)
        assert done.returncode == 2, (args, done.stderr)
        error = json.loads(done.stdout)  # JSON on stdout, the message on stderr as always
        assert error["ok"] is False and error["error"] in (
            "SignatureError", "CorruptCassette", "CassetteNotFound"), (args, error)
        assert error["message"] in done.stderr, (args, done.stderr)


# ------------------------------------------------------------------ deja wait


def test_deja_wait_for_a_port_and_for_steps(project: Path, env: dict[str, str],
                                            completed_run: Path) -> None:
    import socket

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        for target in (str(port), f"127.0.0.1:{port}", f"http://127.0.0.1:{port}/v1"):
            done = deja("wait", target, "--timeout", "30", env=env, cwd=project)
            assert done.returncode == 0, (target, done.stderr)
    gone = deja("wait", str(port), "--timeout", "0.3", env=env, cwd=project)
    assert gone.returncode == 1 and f"something to listen on 127.0.0.1:{port}" in gone.stderr
    bad = deja("wait", "nowhere", env=env, cwd=project)
    assert bad.returncode == 2 and "--steps N" in bad.stderr

    cassette = checked_out(project, completed_run)  # 2 steps and an end line
    steps = len(load(cassette).observations)
    assert deja("wait", str(cassette), "--steps", str(steps), "--timeout", "5", env=env,
                cwd=project).returncode == 0
    assert deja("wait", str(cassette), "--steps", "1000", "--timeout", "5", env=env,
                cwd=project).returncode == 0  # it has ended: nothing more will come
    assert deja("wait", str(cassette), "--timeout", "5", env=env,
                cwd=project).returncode == 0  # without --steps: until it has ended
    open_run = project / "open.jsonl"
    open_run.write_bytes(b"".join(cassette.read_bytes().splitlines(keepends=True)[:2]))
    short = deja("wait", str(open_run), "--steps", "2", "--timeout", "0.3", env=env,
                 cwd=project)
    assert short.returncode == 1 and "to hold 2 steps" in short.stderr
    unended = deja("wait", str(open_run), "--timeout", "0.3", env=env, cwd=project)
    assert unended.returncode == 1 and "open.jsonl to end" in unended.stderr
