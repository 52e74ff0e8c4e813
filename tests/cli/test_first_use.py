"""What a new user meets first, through the real CLI in real processes: a mistyped option,
a cassette copied or moved, a command that cannot start, JSON on stdout, torn and missing
files, and `deja status` given a cassette."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

from deja.cli import main
from recorder.testing.server import StubServer

AGENT = '''\
import os, anthropic
print("agent ran in", os.getcwd())
client = anthropic.Anthropic(api_key="sk-stub")
reply = client.messages.create(model="claude-sonnet-4-6", max_tokens=64,
                               messages=[{"role": "user", "content": "hi"}])
print("model said", reply.content[0].text)
'''


def deja(*args: str, cwd: Path, env: dict[str, str] | None = None,
         stdin: int | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deja", *args], capture_output=True,
                          text=True, cwd=cwd, env={**os.environ, **(env or {})}, timeout=120,
                          stdin=stdin)


def recorded_project(proj: Path, env: dict[str, str]) -> Path:
    """A project with an agent and a cassette recorded in it, the way a user commits one."""
    (proj / "cassettes").mkdir(parents=True)
    (proj / "agent.py").write_text(AGENT)
    with StubServer({"default": {"text": "hello"}}) as server:
        done = deja("record", "-o", "cassettes/run.jsonl", "--", "python", "agent.py",
                    cwd=proj, env={**env, "ANTHROPIC_BASE_URL": server.url})
    assert done.returncode == 0, done.stderr
    return proj


@pytest.fixture(scope="module")
def committed(tmp_path_factory: pytest.TempPathFactory, module_env: dict[str, str]) -> Path:
    return recorded_project(tmp_path_factory.mktemp("first-use") / "proj", module_env)


@pytest.fixture
def project(tmp_path: Path, committed: Path) -> Path:
    """The project as it was committed (recorded once for the module), checked out here."""
    return Path(shutil.copytree(committed, tmp_path / "proj"))


@pytest.fixture
def recorded_here(tmp_path: Path) -> Path:
    """The project recorded by this test, under its own key home, which then holds the
    run's status record."""
    return recorded_project(tmp_path / "proj", {})


def header(path: Path) -> dict:
    return json.loads(path.read_text().splitlines()[0])


# --------------------------------------------------------------------------- options

@pytest.mark.parametrize(("args", "wrong", "meant"), [
    (["record", "--max-turn", "5", "--", "python", "agent.py"], "--max-turn", "--max-turns"),
    (["replay", "cassettes/run.jsonl", "--jsn"], "--jsn", "--json"),
    (["replay", "--foo", "cassettes/run.jsonl"], "--foo", None),
    (["fork", "cassettes/run.jsonl", "--at", "0", "--sett", "result=1"], "--sett", "--set"),
    (["resume", "cassettes/run.jsonl", "--cwdd", "."], "--cwdd", "--cwd"),
])
def test_a_mistyped_option_is_no_such_option_not_the_program(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], wrong: str,
        meant: str | None) -> None:
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2
    assert f"No such option '{wrong}'" in result.output
    if meant:
        assert "Did you mean" in result.output and meant in result.output
    assert "go after --" in result.output
    assert "cannot run" not in result.output and "Cassette" not in result.output
    assert not list(tmp_path.iterdir())  # nothing written, nothing run


def test_the_programs_own_options_pass_after_the_separator(project: Path,
                                                           stub: Callable) -> None:
    server = stub({"default": {"text": "hello"}})
    (project / "flags.py").write_text("import sys; print('argv', sys.argv[1:])\n" + AGENT)
    done = deja("record", "-o", "cassettes/flags.jsonl", "--", "python", "flags.py",
                "--max-turn", "5", "--json", cwd=project, env={"ANTHROPIC_BASE_URL": server.url})
    assert done.returncode == 0, done.stderr
    assert "argv ['--max-turn', '5', '--json']" in done.stdout
    # Without --, deja's options end where the program starts.
    done = deja("record", "-o", "cassettes/bare.jsonl", "python", "flags.py", "-o", "x",
                cwd=project, env={"ANTHROPIC_BASE_URL": server.url})
    assert done.returncode == 0, done.stderr
    assert "argv ['-o', 'x']" in done.stdout


# --------------------------------------------------------------------------- where a replay runs

def test_the_header_stores_the_directory_relative_to_the_cassette(project: Path) -> None:
    h = header(project / "cassettes" / "run.jsonl")
    assert h["cwd"] == ".." and h["cassette"] == "cassettes/run.jsonl"
    assert h["argv"] == ["python", "agent.py"]
    assert str(project) not in json.dumps(h)  # no machine path in a committed cassette


def test_a_committed_cassette_replays_from_anywhere_and_from_another_checkout(
        project: Path, tmp_path: Path) -> None:
    done = deja("replay", str(project / "cassettes" / "run.jsonl"), cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"agent ran in {project}\n" in done.stdout and "identical" in done.stdout
    checkout = tmp_path / "checkout"
    shutil.copytree(project, checkout)
    done = deja("replay", "cassettes/run.jsonl", cwd=checkout)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"agent ran in {checkout}\n" in done.stdout


@pytest.mark.parametrize("where", ["elsewhere/run.jsonl", "proj/run.jsonl"])
def test_a_copied_cassette_never_runs_somewhere_unexpected(project: Path, tmp_path: Path,
                                                           where: str) -> None:
    copy = tmp_path / where
    copy.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(project / "cassettes" / "run.jsonl", copy)
    crashed = copy.with_name("crashed.jsonl")  # what resume takes: no end line
    crashed.write_text("".join(copy.read_text().splitlines(keepends=True)[:-1]))
    for command, path in (("replay", copy), ("resume", crashed)):
        done = deja(command, str(path), cwd=tmp_path)
        assert done.returncode == 2, (command, done.stdout, done.stderr)
        assert "agent ran" not in done.stdout
        assert "DIVERGED" not in done.stdout + done.stderr
        assert "--cwd DIR" in done.stderr and "-- python" in done.stderr
        assert str(copy.parent) in " ".join(done.stderr.split())
    done = deja("fork", str(copy), "--at", "0", "--set", "content.0.text=bye", cwd=tmp_path)
    assert done.returncode == 2 and "--cwd DIR" in done.stderr
    # Told where the project is, the copy replays there.
    done = deja("replay", str(copy), "--cwd", str(project), cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"agent ran in {project}\n" in done.stdout


def test_a_command_that_cannot_start_is_not_a_divergence(project: Path, tmp_path: Path) -> None:
    done = deja("replay", "cassettes/run.jsonl", "--", "python", "missing.py", cwd=project)
    assert done.returncode == 2
    assert "cannot start" in done.stderr and "missing.py" in done.stderr
    assert str(project) in " ".join(done.stderr.split()) and "Nothing was run" in done.stderr
    assert "DIVERGED" not in done.stdout
    (project / "agent.py").rename(project / "moved.py")  # the recorded script is gone
    done = deja("replay", "cassettes/run.jsonl", cwd=project)
    assert done.returncode == 2
    assert "the script agent.py is not in" in done.stderr and "--cwd DIR" in done.stderr
    done = deja("replay", "cassettes/run.jsonl", "--", "python", "-m", "no_such_module_x",
                cwd=project)
    assert done.returncode == 2 and "no module 'no_such_module_x'" in done.stderr


def test_replay_json_is_pure_json_on_stdout(project: Path, stub: Callable) -> None:
    done = deja("replay", "cassettes/run.jsonl", "--json", cwd=project)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)  # the agent's prints went to stderr
    assert result["identical"] is True
    assert "agent ran in" in done.stderr and "model said hello" in done.stderr
    # A diverging replay: still one JSON document on stdout, the divergence in it.
    server = stub({"default": {"text": "hello"}})
    two_calls = AGENT + (
        'reply = client.messages.create(model="claude-sonnet-4-6", max_tokens=64,\n'
        '                               messages=[{"role": "user", "content": "and then?"}])\n'
        'print("model said again", reply.content[0].text)\n')
    (project / "two.py").write_text(two_calls)
    done = deja("record", "-o", "cassettes/two.jsonl", "--", "python", "two.py", cwd=project,
                env={"ANTHROPIC_BASE_URL": server.url})
    assert done.returncode == 0, done.stderr
    (project / "two.py").write_text(two_calls.replace("and then?", "what next?"))
    done = deja("replay", "cassettes/two.jsonl", "--json", cwd=project)
    assert done.returncode == 1, done.stdout + done.stderr
    result = json.loads(done.stdout)
    assert result["identical"] is False
    assert result["divergence"]["step"] == 1 and result["divergence"]["kind"] == "model"
    assert "what next?" in result["divergence"]["diff"]
    # the agent's output up to the divergence, on stderr only
    assert "agent ran in" in done.stderr and "model said hello" in done.stderr
    assert "agent ran" not in done.stdout and "model said" not in done.stdout


# --------------------------------------------------------------------------- torn and missing

def torn_copy(project: Path) -> Path:
    path = project / "cassettes" / "torn.jsonl"
    data = (project / "cassettes" / "run.jsonl").read_bytes()
    lines = data.splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:-1])[:-1] + b"\n" + lines[-1][:10])  # end line cut
    return path


def test_torn_advice_is_one_step_not_two(project: Path) -> None:
    torn = torn_copy(project)
    done = deja("replay", str(torn), cwd=project)
    assert done.returncode == 2 and "TornCassette" in done.stderr
    assert "deja resume" in done.stderr and "--allow-torn" in done.stderr
    done = deja("replay", str(torn), "--allow-torn", cwd=project)
    assert "--allow-incomplete" not in done.stderr, done.stderr
    assert done.returncode == 0, done.stdout + done.stderr
    done = deja("verify", str(torn), "--allow-torn", cwd=project)
    assert done.returncode == 0, done.stderr
    # fork refuses it with the same advice, and the flag it names is one fork has
    done = deja("fork", str(torn), "--at", "0", "--show-document", cwd=project)
    assert done.returncode == 2 and "--allow-torn for deja replay, verify and fork" in \
        done.stderr
    done = deja("fork", str(torn), "--at", "0", "--show-document", "--allow-torn",
                cwd=project)
    assert done.returncode == 0, done.stderr
    assert "content" in json.loads(done.stdout)


def test_a_missing_cassette_is_not_found_with_the_closest_names(project: Path) -> None:
    for command in (["replay"], ["verify"], ["show"], ["fork", "--at", "0", "--show-document"],
                    ["resume"], ["status"]):
        done = deja(command[0], "cassettes/rn.jsonl", *command[1:], cwd=project)
        assert done.returncode == 2, (command, done.stderr)
        assert "CassetteNotFound" in done.stderr, (command, done.stderr)
        assert "did you mean cassettes/run.jsonl?" in done.stderr, (command, done.stderr)
        assert "Traceback" not in done.stderr


# --------------------------------------------------------------------------- status

def test_status_takes_a_cassette_and_reads_it_without_a_status_record(
        recorded_here: Path, tmp_path: Path) -> None:
    project = recorded_here
    cassette = project / "cassettes" / "run.jsonl"
    done = deja("status", str(cassette), cwd=project)
    assert done.returncode == 0, done.stderr
    assert f"run {header(cassette)['run']}: completed" in done.stdout
    elsewhere = {"DEJA_HOME": str(tmp_path / "other-home")}  # no status record there
    done = deja("status", str(cassette), "--json", cwd=project, env=elsewhere)
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout)
    assert (record["status"], record["source"], record["verified"]) == (
        "completed", "cassette", True)
    assert record["totals"]["model_calls"] == 1
    # a cassette cut before its end line, with no writer: crashed
    cut = project / "cassettes" / "cut.jsonl"
    cut.write_text("".join(cassette.read_text().splitlines(keepends=True)[:-1]))
    done = deja("status", str(cut), cwd=project, env=elsewhere)
    assert done.returncode == 0, done.stderr
    assert ": crashed" in done.stdout and f"deja resume {cut}" in done.stdout


def test_status_and_cancel_take_a_run_id_from_a_cassette_only_once_it_verifies(
        recorded_here: Path, tmp_path: Path) -> None:
    project = recorded_here
    cassette = project / "cassettes" / "run.jsonl"
    run = header(cassette)["run"]
    forged = tmp_path / "forged.jsonl"  # names a real run, signed by nobody
    forged.write_text(json.dumps({"format": "deja/1", "run": run, "key_id": "k_0"}) + "\n")
    for command in ("status", "cancel"):
        done = deja(command, str(forged), cwd=project)
        assert done.returncode == 2, (command, done.stdout, done.stderr)
        assert "Traceback" not in done.stderr and "cancel requested" not in done.stdout
    assert not list((Path(os.environ["DEJA_HOME"]) / "runs").glob("*.cancel"))
    for hostile in ("../../../etc/passwd", ".hidden", "r_1/../x"):
        done = deja("status", hostile, cwd=project)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    # an unverified cassette, allowed, is read and marked
    elsewhere = {"DEJA_HOME": str(tmp_path / "h2"), "DEJA_KEY": "another-key-0123456789"}
    done = deja("status", str(cassette), cwd=project, env=elsewhere)
    assert done.returncode == 2 and "UnverifiedCassette" in done.stderr
    done = deja("status", str(cassette), "--allow-unverified", cwd=project, env=elsewhere)
    assert done.returncode == 0, done.stderr
    assert "NOT VERIFIED" in done.stdout and "NOT VERIFIED" in done.stderr


def test_a_package_or_a_pytest_node_is_checked_where_it_runs(project: Path,
                                                             stub: Callable) -> None:
    server = stub({"default": {"text": "hello"}})
    (project / "app").mkdir()
    (project / "app" / "__main__.py").write_text(AGENT)
    done = deja("record", "-o", "cassettes/app.jsonl", "--", "python", "app", cwd=project,
                env={"ANTHROPIC_BASE_URL": server.url})
    assert done.returncode == 0, done.stderr
    done = deja("replay", "cassettes/app.jsonl", cwd=project)
    assert done.returncode == 0, done.stdout + done.stderr
    done = deja("replay", "cassettes/app.jsonl", "--", "python", "-m", "pytest",
                "tests/test_nowhere.py::test_x", cwd=project)
    assert done.returncode == 2 and "the test file tests/test_nowhere.py is not in" in \
        done.stderr
