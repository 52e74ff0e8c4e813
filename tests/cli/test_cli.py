"""The deja command line, end to end: real subprocesses, real stub server, real files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from deja.cli import main
from recorder.testing.server import StubServer
from viewer.index import index_path

ROOT = Path(__file__).resolve().parents[2]
SPIRAL = ROOT / "examples" / "retry_spiral.py"
SPIRAL_SCRIPT = json.loads((ROOT / "examples" / "retry_spiral.stub.json").read_text())
KEY = "test-key-0123456789abcdef"  # conftest's DEJA_KEY
COMMANDS = ["record", "replay", "verify", "show", "ls", "stub", "fork", "resume", "diff",
            "status", "cancel", "wait"]


def deja(*args: str, env: dict | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Run the installed CLI as a user would."""
    return subprocess.run([sys.executable, "-m", "deja", *args], capture_output=True,
                          text=True, env={**os.environ, **(env or {})}, cwd=cwd, timeout=120)


@pytest.fixture(scope="module")
def spiral_recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The retry-spiral example recorded through `deja record`, unmodified, once a module
    (with the suite's signing key)."""
    out = tmp_path_factory.mktemp("spiral") / "spiral.jsonl"
    with StubServer(SPIRAL_SCRIPT) as server:
        proc = deja("record", "-o", str(out), "--label", "case=spiral", "--no-loop-guard",
                    "--", "python", str(SPIRAL),
                    env={"ANTHROPIC_BASE_URL": server.url, "DEJA_KEY": KEY,
                         "DEJA_HOME": str(out.parent / "home")})
        assert len(server.requests) == 5
    assert proc.returncode == 0, proc.stderr
    assert "turn 5: end_turn" in proc.stdout
    return out


@pytest.fixture
def spiral_cassette(spiral_recorded: Path, tmp_path: Path) -> Path:
    """A test's own copy of the recording, to change as it likes."""
    out = tmp_path / "spiral.jsonl"
    out.write_bytes(spiral_recorded.read_bytes())
    return out


@pytest.mark.parametrize("command", [[], *[[c] for c in COMMANDS]])
def test_every_command_has_help(command: list[str]) -> None:
    result = CliRunner().invoke(main, [*command, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output
    if not command:
        for name in COMMANDS:
            assert name in result.output


def test_record_unmodified_script_then_replay_offline(spiral_cassette: Path) -> None:
    lines = [json.loads(line) for line in spiral_cassette.read_text().splitlines()]
    header = lines[0]
    assert header["format"] == "deja/2"
    assert header["argv"] == ["python", "examples/retry_spiral.py"]  # portable: relative
    assert header["labels"] == {"case": "spiral"}
    kinds = [line["kind"] for line in lines[1:]]
    assert kinds == ["model", "tool"] * 4 + ["model", "end"]
    assert lines[-1]["status"] == "completed"

    # The server is gone: the replay runs the recorded command with everything served.
    proc = deja("replay", str(spiral_cassette))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "identical" in proc.stdout
    assert "10/10" not in proc.stdout and "9/9 served" in proc.stdout
    assert "verified with key" in proc.stdout
    assert "turn 5: end_turn" in proc.stdout


def test_replay_of_a_changed_agent_diverges_with_exit_1(spiral_cassette: Path,
                                                        tmp_path: Path) -> None:
    changed = tmp_path / "changed_agent.py"
    changed.write_text(SPIRAL.read_text().replace("Find it first.", "Look in auth/ first."))
    proc = deja("replay", str(spiral_cassette), "--", "python", str(changed))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "DIVERGED" in proc.stdout
    assert "divergence: step 0 (model)" in proc.stdout
    assert "-" in proc.stdout and "Find it first." in proc.stdout
    assert "+" in proc.stdout and "Look in auth/ first." in proc.stdout

    as_json = deja("replay", str(spiral_cassette), "--json", "--", "python", str(changed))
    result = json.loads(as_json.stdout)
    assert result["identical"] is False
    assert result["divergence"]["step"] == 0


def test_replay_of_a_tampered_cassette_exits_2_naming_the_seq(spiral_cassette: Path) -> None:
    lines = spiral_cassette.read_text().splitlines()
    lines[3] = lines[3].replace('"ok"', '"OK"') if '"ok"' in lines[3] else \
        lines[3].replace('"search"', '"searcH"')
    spiral_cassette.write_text("\n".join(lines) + "\n")
    proc = deja("replay", str(spiral_cassette))
    assert proc.returncode == 2
    assert "seq 2" in proc.stderr
    verify = deja("verify", str(spiral_cassette))
    assert verify.returncode == 2
    assert "signature check failed at seq 2" in verify.stderr


def test_verify_needs_the_key(spiral_cassette: Path, tmp_path: Path) -> None:
    ok = deja("verify", str(spiral_cassette))
    assert ok.returncode == 0, ok.stderr
    assert "verified with key" in ok.stdout
    other = deja("verify", str(spiral_cassette),
                 env={"DEJA_KEY": "another-key", "DEJA_HOME": str(tmp_path / "h")})
    assert other.returncode == 2
    assert "UnverifiedCassette" in other.stderr and "signature cannot be checked" in other.stderr
    rotated = deja("verify", str(spiral_cassette),
                   env={"DEJA_KEY": "another-key", "DEJA_HOME": str(tmp_path / "h"),
                        "DEJA_OLD_KEYS": os.environ["DEJA_KEY"]})
    assert rotated.returncode == 0, rotated.stderr


def test_replay_require_signature_without_key_exits_2(spiral_cassette: Path,
                                                      tmp_path: Path) -> None:
    env = {"DEJA_KEY": "", "DEJA_HOME": str(tmp_path / "empty-home")}
    refused = deja("replay", str(spiral_cassette), env=env)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "UnverifiedCassette" in refused.stderr and "--allow-unverified" in refused.stderr
    no_command = deja("replay", str(spiral_cassette), "--allow-unverified", env=env)
    assert no_command.returncode == 2
    assert "does not run the command an unverified header names" in no_command.stderr
    unverified = deja("replay", str(spiral_cassette), "--allow-unverified",
                      "--run-recorded-command", env=env)
    assert unverified.returncode == 0, unverified.stdout + unverified.stderr
    assert "identical (NOT VERIFIED" in unverified.stdout
    assert "WARNING" in unverified.stderr and "NOT VERIFIED" in unverified.stderr
    required = deja("replay", str(spiral_cassette), "--require-signature",
                    "--allow-unverified", "--run-recorded-command", env=env)
    assert required.returncode == 2
    assert "signature cannot be checked" in required.stderr


def test_show_lists_every_step(spiral_cassette: Path) -> None:
    result = CliRunner().invoke(main, ["show", str(spiral_cassette), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["run"]["status"] == "completed"
    assert data["run"]["model_calls"] == 5
    assert [s["kind"] for s in data["steps"]][:2] == ["model", "tool"]
    model = data["steps"][0]
    assert model["input_tokens"] == 412 and model["output_tokens"] == 38
    assert model["cost_usd"] == pytest.approx((412 * 3 + 38 * 15) / 1e6)
    assert data["steps"][1]["name"] == "search"
    table = CliRunner().invoke(main, ["show", str(spiral_cassette)])
    assert table.exit_code == 0, table.output
    assert "claude-sonnet-4-6" in table.output and "412/38" in table.output


def test_ls_indexes_and_rebuilds(spiral_cassette: Path) -> None:
    directory = spiral_cassette.parent
    (directory / "broken.jsonl").write_text('{"format":"deja/99"}\n')
    runner = CliRunner()
    first = runner.invoke(main, ["ls", str(directory), "--json"])
    assert first.exit_code == 0, first.output
    runs = {r["path"].rsplit("/", 1)[-1]: r for r in json.loads(first.output)}
    assert runs["spiral.jsonl"]["status"] == "completed"
    assert runs["spiral.jsonl"]["steps"] == 9
    assert runs["broken.jsonl"]["status"] == "error"
    assert "UnsupportedFormat" in runs["broken.jsonl"]["error"]
    index = index_path(directory)  # under $DEJA_HOME/index, not in the cassette folder
    assert index.exists() and not (directory / ".index.duckdb").exists()
    index.unlink()
    again = runner.invoke(main, ["ls", str(directory), "--json"])
    assert again.exit_code == 0, again.output
    assert sorted(r["run"] or "" for r in json.loads(again.output)) == \
        sorted(r["run"] or "" for r in json.loads(first.output))


def test_record_refuses_to_overwrite_and_bootstrap_fails_loudly(spiral_cassette: Path,
                                                                tmp_path: Path) -> None:
    again = deja("record", "-o", str(spiral_cassette), "--", "python", "-c", "pass")
    assert again.returncode == 2
    assert "already exists" in again.stderr
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    proc = deja("record", "-o", str(blocker / "run.jsonl"), "--", "python", "-c",
                "print('agent ran')")
    assert proc.returncode == 2
    assert f"cannot create {blocker}" in proc.stderr  # refused before the program starts
    assert "agent ran" not in proc.stdout


def test_recording_is_not_inherited_by_child_processes(tmp_path: Path) -> None:
    out = tmp_path / "parent.jsonl"
    code = ("import os, subprocess, sys; "
            "print('mode', os.environ.get('DEJA_MODE')); "
            "subprocess.run([sys.executable, '-c', 'print(\"child ok\")'], check=True)")
    proc = deja("record", "-o", str(out), "--", "python", "-c", code)
    assert proc.returncode == 0, proc.stderr
    # the program may see what deja does with it; its child is still not recorded
    assert "mode record" in proc.stdout and "child ok" in proc.stdout
    assert len(out.read_text().splitlines()) == 2  # header and end: the child added nothing


def test_record_passes_the_program_exit_status_through(tmp_path: Path) -> None:
    proc = deja("record", "-o", str(tmp_path / "r.jsonl"), "--", "python", "-c",
                "raise SystemExit(7)")
    assert proc.returncode == 7
    end = json.loads((tmp_path / "r.jsonl").read_text().splitlines()[-1])
    assert end["status"] == "error" and end["exit_code"] == 7
    assert end["reason"] == "exit status 7"
    bad = deja("record", "-o", str(tmp_path / "e.jsonl"), "--", "python", "-c",
               "raise ValueError('boom')")
    assert bad.returncode == 1
    end = json.loads((tmp_path / "e.jsonl").read_text().splitlines()[-1])
    assert end["status"] == "error"
    assert end["error"]["type"] == "ValueError" and end["error"]["message"] == "boom"


def test_stub_command_serves_a_script(tmp_path: Path) -> None:
    script = tmp_path / "s.json"
    script.write_text(json.dumps({"default": {"text": "hi"}}))
    ready = tmp_path / "url"
    proc = subprocess.Popen([sys.executable, "-m", "deja", "stub", "--script", str(script),
                             "--port", "0", "--ready-file", str(ready)],
                            stderr=subprocess.PIPE, text=True)
    try:
        import time

        for _ in range(200):
            if ready.exists():
                break
            time.sleep(0.02)
        import anthropic

        with anthropic.Anthropic(base_url=ready.read_text(), api_key="sk-x") as client:
            reply = client.messages.create(model="claude-sonnet-4-6", max_tokens=10,
                                           messages=[{"role": "user", "content": "x"}])
        assert reply.content[0].text == "hi"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        proc.stderr.close()
    bad = CliRunner().invoke(main, ["stub", "--script", str(tmp_path / "missing.json")])
    assert bad.exit_code == 2


def test_streaming_example_records_and_replays(tmp_path: Path) -> None:
    script = json.loads((ROOT / "examples" / "streaming_agent.stub.json").read_text())
    out = tmp_path / "stream.jsonl"
    with StubServer(script) as server:
        live = deja("record", "-o", str(out), "--", "python",
                    str(ROOT / "examples" / "streaming_agent.py"),
                    env={"ANTHROPIC_BASE_URL": server.url})
    assert live.returncode == 0, live.stderr
    assert "take the umbrella" in live.stdout
    lines = [json.loads(line) for line in out.read_text().splitlines()[1:]]
    assert [line["kind"] for line in lines] == ["model", "effect", "tool", "model", "end"]
    assert lines[0]["request"]["body"]["stream"] is True and lines[0]["ttft_ms"] > 0
    assert lines[0]["response"]["body"].startswith("event: message_start")
    replayed = deja("replay", str(out))
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    assert live.stdout in replayed.stdout


def test_committed_example_cassette_replays_and_verifies() -> None:
    """cassettes/ holds runs that CI replays; the example is signed with a published key."""
    proc = deja("replay", "cassettes/retry_spiral.jsonl", "--require-signature",
                env={"DEJA_OLD_KEYS": "deja-example-key"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "identical" in proc.stdout and "verified with key" in proc.stdout


def test_loop_guard_stops_the_spiral_and_the_replay_stops_the_same_way(tmp_path: Path) -> None:
    out = tmp_path / "guarded.jsonl"
    with StubServer(SPIRAL_SCRIPT) as server:
        proc = deja("record", "-o", str(out), "--", "python", str(SPIRAL),
                    env={"ANTHROPIC_BASE_URL": server.url})
        assert len(server.requests) == 3  # the third search never ran: no fourth turn
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "stopped by the harness" in proc.stdout
    lines = [json.loads(line) for line in out.read_text().splitlines()[1:]]
    assert [line["kind"] for line in lines] == ["model", "tool", "model", "tool", "model",
                                                "control", "end"]
    control, end = lines[-2], lines[-1]
    assert control["event"] == "loop_detected"
    assert control["detail"]["tool"] == "search" and control["detail"]["times"] == 3
    assert end["status"] == "stopped" and end["reason"] == "loop_detected"
    replayed = deja("replay", str(out))
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    assert "identical" in replayed.stdout and "stopped by the harness" in replayed.stdout


def test_show_and_ls_show_lineage(spiral_cassette: Path) -> None:
    import replayer

    fixed = json.dumps({"results": [{"path": "auth/session.py", "snippet": "def refresh()"}]})
    script = {"turns": [{"text": "Found it."}]}
    with StubServer(script) as server:
        os.environ["ANTHROPIC_BASE_URL"] = server.url
        try:
            sys.path.insert(0, str(SPIRAL.parent))
            import retry_spiral

            out = spiral_cassette.parent / "fork.jsonl"
            with replayer.fork(spiral_cassette, at=1, sets=[f"/result={fixed}"], out=out):
                assert retry_spiral.main() == 0
        finally:
            del os.environ["ANTHROPIC_BASE_URL"]
    parent = CliRunner().invoke(main, ["show", str(spiral_cassette), "--json"])
    children = json.loads(parent.output)["children"]
    assert [(c["step"], Path(c["path"]).name) for c in children] == [(1, "fork.jsonl")]
    child = CliRunner().invoke(main, ["show", str(out)])
    assert "forked from r_" in child.output and "at step 1" in child.output
    listed = CliRunner().invoke(main, ["ls", str(spiral_cassette.parent)])
    assert listed.exit_code == 0, listed.output
    assert "@1" in listed.output


def test_wait_for_a_cassette_counts_its_steps_and_sees_its_end(spiral_cassette: Path,
                                                                tmp_path: Path) -> None:
    lines = spiral_cassette.read_bytes().splitlines(keepends=True)
    growing = tmp_path / "growing.jsonl"
    growing.write_bytes(b"".join(lines[:-1]) + lines[-1][:25])  # the end line torn

    def wait(*args: str) -> int:
        return CliRunner().invoke(main, ["wait", str(growing), "--timeout", "0", *args],
                                  catch_exceptions=False).exit_code

    steps = len(lines) - 2
    assert wait("--steps", str(steps)) == 0 and wait("--steps", str(steps + 1)) == 1
    assert wait() == 1  # a torn end line is no end
    growing.write_bytes(b"".join(lines))
    assert wait() == 0 and wait("--steps", "1000") == 0  # ended: nothing more to wait for


def _imported(*args: str) -> set[str]:
    """The modules ``deja ARGS`` has imported when it exits (whatever its status), in a
    fresh interpreter."""
    code = ("import json, sys\nfrom deja.cli import main\ntry:\n    main()\n"
            "except SystemExit:\n    pass\nprint(json.dumps(sorted(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=60)
    return set(json.loads(done.stdout.splitlines()[-1]))


def test_a_command_imports_what_it_needs_and_not_the_other_commands() -> None:
    """Each command of deja's group is imported when it runs: ``--version`` imports none
    of deja's packages, ``verify`` reads a cassette without the replayer, the server, the
    proxy or the suite, and ``--help`` still lists them all."""
    version = _imported("--version")
    assert "deja.cli" in version
    assert not {m for m in version if m.split(".")[0] in ("recorder", "replayer", "viewer")}
    verify = _imported("verify", str(ROOT / "tests" / "golden" / "v2_tool_agent.jsonl"))
    assert {"deja.cli_inspect", "recorder.cassette.reader"} <= verify
    assert not verify & {"replayer", "deja.cli_serve", "deja.cli_proxy", "deja.cli_suite"}
    listed = CliRunner().invoke(main, ["--help"]).output
    for name in ("verify", "serve", "proxy", "suite", "sweep", "record", "replay"):
        assert f"\n  {name} " in listed
