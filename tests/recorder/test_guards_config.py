"""Guard configuration: bad budgets, prices and ``[tool.deja]`` tables are config errors at
the start, and flags, arguments and the file override each other in that order.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import guard_helpers
import pytest
from click.testing import CliRunner
from conftest import read_lines
from guard_agents.chatty import ask, client
from guard_helpers import CHATTY, SCRIPT, assert_stopped, chat, deja, end_of

import recorder
from deja.cli import main as cli
from recorder import BudgetExhausted, Budgets, ConfigError

# Fixtures shared by the test_guards files.
breaker_clock = guard_helpers.breaker_clock


# ------------------------------------------------------------------------------ configuration


@pytest.mark.parametrize(("budgets", "words"), [
    ({"turns": -1}, ["turns", "negative"]),
    ({"seconds": -0.5}, ["seconds", "negative"]),
    ({"tokens": "lots"}, ["tokens", "number", "'lots'"]),
    ({"dollars": "5"}, ["dollars", "number"]),
    ({"turns": True}, ["turns", "number"]),
    ({"seconds": float("nan")}, ["seconds", "number"]),
    ({"max_tokens": 1.5}, ["max_tokens", "whole"]),
    ({"turnz": 3}, ["unknown budget", "turnz"]),
    ({"max_tokens_mode": "squash"}, ["max_tokens_mode", "squash"]),
    ([("turns", 3)], ["budgets must be a table"]),
])
def test_bad_budget_is_a_config_error_at_start(stub, tmp_path: Path, budgets: Any,
                                               words: list[str]) -> None:
    server = stub(SCRIPT)
    path = tmp_path / "bad.jsonl"
    with pytest.raises(ConfigError) as raised:
        with recorder.record(path, budgets=budgets):
            ask(client(server.url), 0)
    for word in words:
        assert word in str(raised.value)
    assert not path.exists() and server.requests == []


@pytest.mark.parametrize(("prices", "words"), [
    ({"my-tune": [2.0]}, ["my-tune"]),
    ({"my-tune": "cheap"}, ["my-tune"]),
    ({"my-tune": [2.0, "x"]}, ["my-tune"]),
    ({"my-tune": {"input": 1.0, "outptu": 2.0}}, ["my-tune"]),
    ({"my-tune": [-1.0, 2.0]}, ["my-tune", "negative"]),
])
def test_malformed_price_is_a_config_error_at_start(tmp_path: Path, prices: dict,
                                                    words: list[str]) -> None:
    with pytest.raises(ConfigError) as raised:
        recorder.record(tmp_path / "bad.jsonl", prices=prices)
    for word in words:
        assert word in str(raised.value)


@pytest.fixture
def pyproject(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[str], Path]:
    """Write a pyproject.toml and point DEJA_CONFIG at it."""
    def write(text: str) -> Path:
        path = tmp_path / "conf" / "pyproject.toml"
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
        monkeypatch.setenv("DEJA_CONFIG", str(path))
        return path
    return write


@pytest.mark.parametrize(("toml", "words"), [
    ("[tool.deja\nturns = 3\n", ["cannot read"]),
    ("[tool.deja]\nbudget = {turns = 3}\n", ["unknown [tool.deja] key", "budget"]),
    ("[tool]\ndeja = 3\n", ["must be a table"]),
    ("[tool.deja.budgets]\nturns = -5\n", ["turns", "negative"]),
    ("[tool.deja.budgets]\ntokens = \"many\"\n", ["tokens", "number"]),
    ("[tool.deja.budgets]\nturnz = 3\n", ["turnz"]),
    ("[tool.deja]\nbudgets = 5\n", ["budgets"]),
    ("[tool.deja.prices]\n\"my-tune\" = [2.0]\n", ["my-tune"]),
    ("[tool.deja]\nprices = 5\n", ["prices"]),
    ("[tool.deja.loop]\nrepeats = 1\n", ["repeats"]),
    ("[tool.deja.loop]\nrepat = 4\n", ["repat"]),
    ("[tool.deja.breaker]\nfailures = \"many\"\n", ["failures"]),
    ("[tool.deja.breaker]\ncooldown = -1\n", ["cooldown"]),
])
def test_malformed_tool_deja_is_a_config_error_naming_the_file(
        pyproject: Callable[[str], Path], tmp_path: Path, toml: str, words: list[str]) -> None:
    conf = pyproject(toml)
    with pytest.raises(ConfigError) as raised:
        recorder.record(tmp_path / "bad.jsonl")
    message = str(raised.value)
    assert str(conf) in message
    for word in words:
        assert word in message
    # deja record refuses it too, before starting the program
    result = CliRunner().invoke(cli, ["record", "-o", str(tmp_path / "cli.jsonl"), "--",
                                      "python", "-c", "pass"])
    assert result.exit_code == 2 and str(conf) in result.output
    assert not (tmp_path / "cli.jsonl").exists()


def test_missing_config_file_is_a_config_error(pyproject: Callable[[str], Path],
                                               tmp_path: Path) -> None:
    conf = pyproject("")
    conf.unlink()
    with pytest.raises(ConfigError, match="cannot read"):
        recorder.record(tmp_path / "x.jsonl")


@pytest.mark.parametrize("args", [["--max-turns", "-1"], ["--max-tokens", "-5"],
                                  ["--max-seconds", "-1"], ["--max-dollars", "x"]])
def test_deja_record_refuses_a_bad_budget_flag(tmp_path: Path, args: list[str]) -> None:
    out = tmp_path / "x.jsonl"
    result = CliRunner().invoke(cli, ["record", "-o", str(out), *args, "--", "python", "-c",
                                      "raise SystemExit(9)"])
    assert result.exit_code == 2, result.output
    assert args[0] in result.output
    assert not out.exists()


def test_tool_deja_budgets_apply_and_explicit_arguments_override_them(
        pyproject: Callable[[str], Path], stub, tmp_path: Path) -> None:
    pyproject("[tool.deja.budgets]\nturns = 2\nmax_tokens = 8192\n\n"
              "[tool.deja.loop]\nrepeats = 4\nwindow = 6\n")
    server = stub(SCRIPT)

    path = tmp_path / "file.jsonl"
    with pytest.raises(BudgetExhausted), recorder.record(path):
        chat(client(server.url), 10)
    assert len(server.requests) == 2
    header = read_lines(path)[0]
    assert header["budgets"] == {"turns": 2, "max_tokens": 8192, "seconds": 3600.0,
                                 "max_tokens_mode": "refuse"}
    assert header["loop"]["repeats"] == 4 and header["loop"]["window"] == 6
    assert_stopped(path, budget="turns", used=2, limit=2, models=2)

    path = tmp_path / "args.jsonl"
    with pytest.raises(BudgetExhausted), recorder.record(path, budgets={"turns": 4}):
        chat(client(server.url), 10)
    assert len(server.requests) == 2 + 4
    header = read_lines(path)[0]
    assert header["budgets"]["turns"] == 4 and header["budgets"]["max_tokens"] == 8192

    # A Budgets object replaces the defaults and the file whole.
    path = tmp_path / "object.jsonl"
    with recorder.record(path, budgets=Budgets(turns=5)):
        chat(client(server.url), 5, max_tokens=50_000)
    assert read_lines(path)[0]["budgets"] == {"turns": 5, "max_tokens_mode": "refuse"}
    assert end_of(path)["status"] == "completed"


def test_deja_record_flags_override_tool_deja(pyproject: Callable[[str], Path], stub,
                                              tmp_path: Path) -> None:
    pyproject("[tool.deja.budgets]\nturns = 2\ntokens = 100000\n")
    server = stub(SCRIPT)
    path = tmp_path / "flags.jsonl"
    proc = deja("record", "-o", str(path), "--max-turns", "3", "--", "python", str(CHATTY),
                env={"ANTHROPIC_BASE_URL": server.url, "CHATTY_TURNS": "10"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "stopped: BudgetExhausted" in proc.stdout
    assert len(server.requests) == 3
    assert read_lines(path)[0]["budgets"]["tokens"] == 100_000  # the file's, kept
    assert_stopped(path, budget="turns", used=3, limit=3, models=3)
    assert end_of(path)["exit_code"] == 0  # the agent caught it and exited normally


def test_tool_deja_is_parsed_once_per_text_and_an_edit_is_read_at_once(
        pyproject: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A proxy resolves the settings for each new run: the file is read every time, and
    parsed again only when its text changed (an edit of the same length within the same
    clock tick included)."""
    from recorder.harness import settings

    parsed: list[str] = []
    real = settings.tomllib.loads

    def counting(text: str) -> dict[str, Any]:
        parsed.append(text)
        return real(text)

    monkeypatch.setattr(settings.tomllib, "loads", counting)
    conf = pyproject("[tool.deja.budgets]\nturns = 3\n")
    for _ in range(3):
        assert settings.resolve().budgets.turns == 3
    assert len(parsed) == 1
    conf.write_text("[tool.deja.budgets]\nturns = 4\n")  # same size, at once
    assert settings.resolve().budgets.turns == 4
    assert len(parsed) == 2
    table, _ = settings.project_settings()
    table["budgets"]["turns"] = 99  # the caller's copy: the next run reads the file's
    assert settings.resolve().budgets.turns == 4
