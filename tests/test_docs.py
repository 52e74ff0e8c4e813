"""The README tells the truth: its commands exist, its example runs, its demo works."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from deja.cli import main
from recorder.stubserver import StubServer

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_every_cli_command_is_in_the_readme_and_back() -> None:
    commands = set(main.commands)
    for name in commands:
        assert f"`deja {name}" in README, f"deja {name} is not documented in the README"
    mentioned = set(re.findall(r"`deja ([a-z]+)", README)) | set(
        re.findall(r"^\$ deja ([a-z]+)", README, flags=re.M))
    assert mentioned <= commands, f"README mentions unknown commands {mentioned - commands}"


def test_the_two_commands_come_first() -> None:
    first_block = README.split("```console", 1)[1].split("```", 1)[0]
    assert "make demo" in first_block and "make test" in first_block
    assert README.index("make demo") < README.index("## Record and replay")


def test_the_ten_line_example_records_and_replays(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    code = README.split("## Record and replay in ten lines", 1)[1]
    code = code.split("```python", 1)[1].split("```", 1)[0]
    assert len([line for line in code.strip().splitlines() if line.strip()]) <= 16
    live, offline = code.split("with replayer.replay", 1)
    offline = "with replayer.replay" + offline
    calls: list[str] = []

    class Backend:
        @staticmethod
        def search(query: str) -> str:
            calls.append(query)
            return f" [found {query}]"

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-readme")
    namespace: dict = {"backend": Backend}
    with StubServer({"default": {"text": "Patched."}}) as server:
        monkeypatch.setenv("ANTHROPIC_BASE_URL", server.url)
        exec(compile(live, "README-live", "exec"), namespace)
    assert calls == ["session refresh"]
    exec(compile(offline.replace("print(", "report = ("), "README-replay", "exec"), namespace)
    assert calls == ["session refresh"], "the tool ran again during replay"
    assert namespace["run"].result.identical
    assert "identical" in namespace["report"]


def test_make_demo_script_runs_offline(tmp_path: Path) -> None:
    env = {**os.environ, "BIN": str(Path(sys.executable).parent),
           "DEJA_HOME": str(tmp_path / "home")}
    proc = subprocess.run(["bash", str(ROOT / "examples" / "demo.sh")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "identical" in proc.stdout
    assert "verified with key" in proc.stdout
    assert "stopped by the harness" in proc.stdout  # the loop guard ended the spiral
    assert "loop_detected" in proc.stdout


def test_help_texts_name_the_exit_statuses() -> None:
    result = CliRunner().invoke(main, ["replay", "--help"])
    assert "Exit 0 identical, 1 diverged, 2 bad cassette" in " ".join(result.output.split())
