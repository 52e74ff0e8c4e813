"""One count everywhere, one report per divergence, and progress on a terminal.

Runs are recorded with ``deja record`` (a real subprocess, the real anthropic SDK against
the stub server) from ``tests/count_agent.py``, and read back through every command that
counts: ``deja verify``, ``show``, ``ls``, ``diff`` and ``replay`` must agree on the
number of steps (every observation line, the end line excepted) and on the totals.
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import read_lines

from deja.cli import main as cli
from recorder.testing.server import StubServer

AGENT = Path(__file__).resolve().parents[1] / "count_agent.py"
sys.path.insert(0, str(AGENT.parent))

from count_agent import SCRIPT  # noqa: E402


def deja(*args: str, env: dict[str, str] | None = None,
         cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "deja", *args], capture_output=True,
                          text=True, env={**os.environ, **(env or {})}, cwd=cwd, timeout=120)


def cli_run(*args: str) -> str:
    result = CliRunner().invoke(cli, list(args))
    assert result.exit_code in (0, 1), result.output
    return result.output


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """The agent in a project directory, as a user has it."""
    (tmp_path / "agent.py").write_text(AGENT.read_text())
    return tmp_path


def record(project: Path, name: str, url: str, **env: str) -> Path:
    out = project / "cassettes" / f"{name}.jsonl"
    proc = deja("record", "-o", str(out), "--", "python", "agent.py", cwd=project,
                env={"ANTHROPIC_BASE_URL": url, **env})
    assert out.exists(), proc.stdout + proc.stderr
    return out


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory, module_env: dict[str, str]) -> Path:
    """The runs the tests read, recorded once for the module (each test gets copies, in its
    own project): ``run``, whole; ``resumed``, killed before its third turn, then resumed
    (a ``resumed`` line in the middle); ``long``, 300 effects and no model call."""
    project = tmp_path_factory.mktemp("counts")
    (project / "agent.py").write_text(AGENT.read_text())
    with StubServer(SCRIPT) as server:
        record(project, "run", server.url, **module_env)
        crashed = record(project, "resumed", server.url, AGENT_DIE_AT="2", **module_env)
        assert read_lines(crashed)[-1]["kind"] != "end"
        proc = deja("resume", str(crashed), env={**module_env, "ANTHROPIC_BASE_URL": server.url})
        assert proc.returncode == 0, output(proc)
    record(project, "long", "http://127.0.0.1:9", AGENT_EFFECTS="300", AGENT_TURNS="0",
           **module_env)
    return project / "cassettes"


def copy_of(recorded: Path, name: str, project: Path) -> Path:
    """The recorded run ``name`` in ``project``, where it would have been recorded (its
    header names the directory it ran in relative to the cassette)."""
    out = project / "cassettes" / f"{name}.jsonl"
    out.parent.mkdir(exist_ok=True)
    shutil.copyfile(recorded / f"{name}.jsonl", out)
    return out


@pytest.fixture
def run(project: Path, recorded: Path) -> Path:
    return copy_of(recorded, "run", project)


def output(proc: subprocess.CompletedProcess[str]) -> str:
    return proc.stdout + proc.stderr


# -- one definition of a step


def test_every_command_counts_the_same_steps(run: Path) -> None:
    lines = read_lines(run)
    steps = len(lines) - 2  # the header and the end line are no steps
    kinds = [line["kind"] for line in lines[1:-1]]
    # the case that made verify and replay disagree: lines made inside a tool's body
    assert any("within" in line for line in lines[1:-1]), kinds

    verify = cli_run("verify", str(run))
    assert f", {steps} steps," in verify, verify
    shown = json.loads(cli_run("show", str(run), "--json"))
    assert shown["run"]["steps"] == len(shown["steps"]) == steps
    listed = json.loads(cli_run("ls", str(run.parent), "--json"))
    assert [r["steps"] for r in listed] == [steps]
    compared = json.loads(cli_run("diff", str(run), str(run), "--json"))
    assert compared["steps_a"] == compared["steps_b"] == compared["same_prefix"] == steps
    assert f"({steps} steps)" in cli_run("diff", str(run), str(run))

    proc = deja("replay", str(run), "--json")
    assert proc.returncode == 0, output(proc)
    replayed = json.loads(proc.stdout)
    assert replayed["steps_recorded"] == replayed["steps_served"] == steps
    assert replayed["totals"]["all"] == {k: shown["run"][k] for k in replayed["totals"]["all"]}
    text = deja("replay", str(run))
    assert f"{steps}/{steps} served" in text.stdout, output(text)


def test_totals_are_the_sums_of_the_steps(run: Path) -> None:
    shown = json.loads(cli_run("show", str(run), "--json"))
    rows, summary = shown["steps"], shown["run"]
    assert summary["model_calls"] == sum(r["kind"] == "model" for r in rows) == 4
    assert summary["tool_calls"] == sum(r["kind"] == "tool" for r in rows) == 3
    assert summary["input_tokens"] == 120 + 180 + 220 + 260
    assert summary["output_tokens"] == 20 + 22 + 18 + 9
    assert summary["cost_usd"] == round(sum(r["cost_usd"] or 0 for r in rows), 8) > 0
    assert summary["replayed"] is None and summary["live"] is None  # nothing was replayed
    assert "4 model calls, 3 tool calls, 780 in / 69 out tokens" in cli_run("show", str(run))


def test_served_in_is_the_time_spent_serving_not_the_start_up(run: Path) -> None:
    started = time.perf_counter()
    proc = deja("replay", str(run), "--json", env={"AGENT_STARTUP": "2"})
    took = time.perf_counter() - started
    assert proc.returncode == 0, output(proc)
    # The 2 s the program sleeps before its first call are not serving time: what was served
    # and that sleep fit in the whole run, however slow a busy machine makes the serving.
    served_in = json.loads(proc.stdout)["seconds"]
    assert 0 < served_in and served_in + 2.0 <= took, (served_in, took)


# -- forks and resumed runs: numbering by seq, replayed apart from live


@pytest.fixture
def resumed(project: Path, recorded: Path) -> Path:
    """A run killed before its third turn, then resumed: a ``resumed`` line in the middle."""
    return copy_of(recorded, "resumed", project)


def test_diff_of_a_fork_of_a_resumed_run_names_steps_by_seq(
        resumed: Path, project: Path, stub: Callable[[dict], StubServer]) -> None:
    lines = read_lines(resumed)
    marker = next(line["seq"] for line in lines if line.get("event") == "resumed")
    at = next(line["seq"] for line in lines[1:-1]
              if line["kind"] == "tool" and line["seq"] > marker)
    fork = project / "cassettes" / "fork.jsonl"
    proc = deja("fork", str(resumed), "--at", str(at), "--set", 'result=["nowhere.py"]',
                "-o", str(fork), env={"ANTHROPIC_BASE_URL": stub(SCRIPT).url})
    assert fork.exists(), output(proc)

    text = cli_run("diff", str(resumed), str(fork))
    assert f"first divergence: step {at}\n" in text, text
    assert f"step {at} (tool):" in text, text
    assert f"steps 0-{at - 1}: identical ({at - 1} steps and 1 bookkeeping line)" in text, text
    data = json.loads(cli_run("diff", str(resumed), str(fork), "--json"))
    assert data["first_divergence"] == data["steps"][0]["seq"] == at
    assert data["steps_a"] == len(lines) - 2 and data["steps_b"] == len(read_lines(fork)) - 2


def test_a_fork_and_a_resumed_run_tell_replayed_from_live(
        resumed: Path, project: Path, stub: Callable[[dict], StubServer]) -> None:
    lines = read_lines(resumed)
    marker = next(line["seq"] for line in lines if line.get("event") == "resumed")
    shown = json.loads(cli_run("show", str(resumed), "--json"))["run"]
    before = [line for line in lines[1:-1] if line["seq"] < marker]
    assert shown["live_from"] == marker and shown["replayed_from"] == "earlier attempts"
    assert shown["replayed"]["model_calls"] == sum(x["kind"] == "model" for x in before) == 2
    assert shown["replayed"]["model_calls"] + shown["live"]["model_calls"] == 4
    assert (shown["replayed"]["cost_usd"] + shown["live"]["cost_usd"]
            == pytest.approx(shown["cost_usd"]))
    text = cli_run("show", str(resumed))
    assert f"replayed from earlier attempts (steps 0-{marker - 1}): 2 model calls" in text
    assert f"live (steps {marker}-{len(lines) - 3}): 2 model calls" in text
    # the end line says what was replayed as well
    assert lines[-1]["totals"]["replayed"]["model_calls"] == 2

    # steps 0-3 from the parent: the model call, the effect inside the tool, the tool
    # (edited) and the fork_edit line; live from step 4
    assert [line["kind"] for line in lines[1:4]] == ["model", "effect", "tool"]
    fork = project / "cassettes" / "fork.jsonl"
    proc = deja("fork", str(resumed), "--at", "2", "--set", 'result=["nowhere.py"]', "-o",
                str(fork), env={"ANTHROPIC_BASE_URL": stub(SCRIPT).url})
    assert proc.returncode == 0, output(proc)
    forked = json.loads(cli_run("show", str(fork), "--json"))["run"]
    parent = lines[0]["run"]
    assert forked["live_from"] == 4
    assert forked["replayed"]["model_calls"] == 1 and forked["replayed"]["tool_calls"] == 1
    assert forked["replayed"]["input_tokens"] == 120
    assert forked["live"]["model_calls"] == forked["model_calls"] - 1 > 0
    text = cli_run("show", str(fork))
    assert f"replayed from parent {parent} (steps 0-3): 1 model call, 1 tool call" in text
    assert "live (steps 4-" in text
    assert read_lines(fork)[-1]["totals"]["replayed"]["model_calls"] == 1

    proc = deja("replay", str(fork))
    assert proc.returncode == 0, output(proc)
    assert f"replayed from parent {parent} (steps 0-3): 1 model call" in proc.stdout
    assert "live (steps 4-" in proc.stdout


# -- a divergence is reported once, by deja, without the SDK's traceback


def test_a_divergence_in_deja_replay_is_one_report_without_traceback(run: Path) -> None:
    proc = deja("replay", str(run), env={"AGENT_PROMPT": "Find the token refresh code."})
    assert proc.returncode == 1, output(proc)
    text = output(proc)
    assert "DIVERGED" in text and "divergence: step 0 (model)" in text
    assert text.count("--- recorded") == 1 and text.count("+++ replayed") == 1
    assert text.count("Find the token refresh code.") == 1  # the diff, once
    assert "Traceback" not in text and "_base_client" not in text and "anthropic/" not in text


def test_the_agents_own_error_still_prints_its_traceback(run: Path) -> None:
    proc = deja("replay", str(run), env={"AGENT_CRASH": "1"})
    assert proc.returncode == 1, output(proc)
    assert "Traceback" in proc.stderr and "ValueError: the agent's own bug" in proc.stderr
    assert "DIVERGED" in proc.stdout  # and the steps it never asked for fail the replay


def test_a_divergence_in_a_fork_is_one_message_without_traceback(
        run: Path, project: Path, stub: Callable[[dict], StubServer]) -> None:
    proc = deja("fork", str(run), "--at", "2", "--set", 'result=["nowhere.py"]',
                "-o", str(project / "f.jsonl"),
                env={"ANTHROPIC_BASE_URL": stub(SCRIPT).url,
                     "AGENT_PROMPT": "Find the token refresh code."})
    assert proc.returncode != 0, output(proc)
    text = output(proc)
    assert "deja: Divergence: replay diverged at step 0 (model, changed request)" in text
    assert text.count("--- recorded") == 1 and text.count("Find the token refresh code.") == 1
    assert "Traceback" not in text and "_base_client" not in text


# -- progress on a terminal, nothing when piped


def _run_in_pty(argv: list[str], cwd: Path, env: dict[str, str]) -> tuple[int, bytes]:
    master, slave = pty.openpty()
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, cwd=cwd,
                            env={**os.environ, "TERM": "xterm-256color", "COLUMNS": "120",
                                 **env}, close_fds=True)
    os.close(slave)
    out = bytearray()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    os.close(master)
    return proc.wait(timeout=30), bytes(out)


@pytest.fixture
def long_run(project: Path, recorded: Path) -> Path:
    return copy_of(recorded, "long", project)


def test_a_long_replay_shows_progress_on_a_terminal(long_run: Path, project: Path) -> None:
    assert len(read_lines(long_run)) == 302
    code, out = _run_in_pty([sys.executable, "-m", "deja", "replay", str(long_run)], project,
                            {"AGENT_TURNS": "0", "AGENT_EFFECTS": "300"})
    text = out.decode("utf-8", "replace")
    assert code == 0, text
    assert "deja\x1b[0m replaying" in text and "recorded calls served" in text
    counts = {int(n) for n in re.findall(r"(\d+)/300\x1b", text)}  # the bar's count, as it moves
    assert 0 in counts and 300 in counts and len(counts) > 2, counts
    # the program's own output arrives whole, above the bar
    plain = text.replace("\r\n", "\n")
    assert all(f"effect {i}: " in plain for i in range(300))
    assert "replay of r_" in text and "300/300 served" in text  # then the report


def test_a_piped_replay_shows_no_progress(long_run: Path, project: Path) -> None:
    proc = deja("replay", str(long_run), cwd=project,
                env={"AGENT_TURNS": "0", "AGENT_EFFECTS": "300"})
    assert proc.returncode == 0, output(proc)
    assert "replaying" not in output(proc) and "\x1b[" not in output(proc)
    assert proc.stdout.count("effect ") == 300


def test_a_replayed_harness_stop_is_one_line(project: Path,
                                             stub: Callable[[dict], StubServer]) -> None:
    url = stub(SCRIPT).url
    out = project / "cassettes" / "budget.jsonl"
    recorded = deja("record", "--max-turns", "2", "-o", str(out), "--", "python", "agent.py",
                    cwd=project, env={"ANTHROPIC_BASE_URL": url})
    assert "BudgetExhausted" in recorded.stderr, output(recorded)
    proc = deja("replay", str(out))
    assert proc.returncode == 0, output(proc)  # the recorded run stopped there too
    assert "Traceback" not in proc.stderr and "_base_client" not in proc.stderr
    assert proc.stderr.count("deja: BudgetExhausted: ") == 1, proc.stderr
    assert "[replayed from seq" in proc.stderr and ": identical" in proc.stdout


def test_a_long_resume_shows_progress_until_it_goes_live(project: Path) -> None:
    crashed = record(project, "crashed", "http://127.0.0.1:9", AGENT_EFFECTS="300",
                     AGENT_TURNS="1", AGENT_DIE_AT="0")
    assert read_lines(crashed)[-1]["kind"] == "effect"  # killed: no end line
    code, out = _run_in_pty([sys.executable, "-m", "deja", "resume", str(crashed)], project,
                            {"AGENT_TURNS": "0", "AGENT_EFFECTS": "300"})
    text = out.decode("utf-8", "replace")
    assert code == 0, text
    assert "resume: replaying the recorded steps" in text and "recorded calls served" in text
    assert read_lines(crashed)[-1]["status"] == "completed"


def test_a_long_fork_shows_progress_until_it_goes_live(
        project: Path, stub: Callable[[dict], StubServer]) -> None:
    url = stub(SCRIPT).url
    steered = {"AGENT_EFFECTS": "300", "AGENT_TURNS": "2"}
    parent = record(project, "parent", url, **steered)
    lines = read_lines(parent)
    assert lines[-1]["status"] == "completed", lines[-1]
    at = next(line["seq"] for line in lines[1:-1] if line["kind"] == "tool")
    assert at > 300  # the 300 effects and the first model call come before it
    fork = project / "cassettes" / "fork.jsonl"
    code, out = _run_in_pty([sys.executable, "-m", "deja", "fork", str(parent), "--at",
                             str(at), "--set", 'result=["nowhere.py"]', "-o", str(fork)],
                            project, {**steered, "ANTHROPIC_BASE_URL": url})
    text = out.decode("utf-8", "replace")
    assert code == 0, text
    assert "deja\x1b[0m fork: replaying the recorded steps" in text, text
    assert "recorded calls served" in text
    bars = {(int(n), int(total)) for n, total in re.findall(r"(\d+)/(\d+)\x1b", text)}
    assert {total for _, total in bars} == {at}, bars  # the steps before the edited one
    counts = {n for n, _ in bars}  # the bar, as it moves
    assert 0 in counts and at in counts and len(counts) > 2, counts
    # the program's own output arrives whole, above the bar, and the fork goes on live
    plain = text.replace("\r\n", "\n")
    assert all(f"effect {i}: " in plain for i in range(300))
    assert "turn 1: Narrowing it down." in plain
    forked = read_lines(fork)
    assert forked[-1]["status"] == "completed"
    assert sum(line["kind"] == "model" for line in forked[1:-1]) == 2  # the second live

