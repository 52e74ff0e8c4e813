"""A cassette's text in deja's tables is shown as it is: never read as rich's markup or
emoji codes, and never handed to the terminal as a control sequence.

A tool's name, its error, a run's labels and a folder's name are data: ``[/]`` in one used
to stop ``deja show`` and ``deja ls`` with rich's MarkupError traceback, ``[prod]`` was
left out of the table, ``:skull:`` drawn as an emoji and an escape sequence (colours, a
terminal's title, a hyperlink) passed through to the terminal. deja's reports print what an
agent sent and got (a divergence's diff, ``deja diff``, a fork's document): the controls a
recorded prompt or tool result holds are written as escapes there too. The commands run as
a user runs them, in their own process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import recorder
from tests.conftest import TEST_KEY
from tests.tamper import join, resign

HOSTILE = "[/] [prod] :skull: [link=http://evil.example]x[/link] \x1b[31mred\x1b[0m \u202eevil"
# as the table writes it: the markup as it is, the controls as their escapes
SHOWN = ("[/] [prod] :skull: [link=http://evil.example]x[/link] \\x1b[31mred\\x1b[0m "
         "\\u202eevil")


def _record(folder: Path) -> Path:
    folder.mkdir()
    path = folder / "hostile.jsonl"

    @recorder.tool(name="lookup[/]")
    def lookup(query: str) -> str:
        raise ValueError(HOSTILE)

    with recorder.record(path, labels={"team": HOSTILE}):
        with pytest.raises(ValueError):
            lookup("x")
    return path


def _deja(*args: str | Path, env: dict[str, str] | None = None
          ) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "400", "NO_COLOR": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "deja", *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=120)


def test_show_and_ls_show_a_cassettes_text_as_it_is(tmp_path: Path) -> None:
    path = _record(tmp_path / "runs [prod] :skull:")
    shown = _deja("show", path)
    assert shown.returncode == 0, shown.stderr
    assert "Traceback" not in shown.stderr
    assert "lookup[/]" in shown.stdout
    assert SHOWN in shown.stdout.replace("\n", "")  # a long cell may fold
    assert "\x1b" not in shown.stdout and "\u202e" not in shown.stdout
    assert "💀" not in shown.stdout

    listed = _deja("ls", path.parent)
    assert listed.returncode == 0, listed.stderr
    assert "Traceback" not in listed.stderr
    assert f"runs in {path.parent}" in listed.stdout
    flat = "".join(line.strip() for line in listed.stdout.splitlines())
    assert "[/][prod]:skull:" in flat.replace(" ", "")  # the label, folded as it may be
    assert "\x1b" not in listed.stdout and "💀" not in listed.stdout


AGENT = '''import os
import anthropic
import recorder

EVIL = {evil!r}


@recorder.tool(name="lookup")
def lookup(query: str) -> str:
    return "result " + EVIL


client = anthropic.Anthropic(base_url=os.environ.get("ANTHROPIC_BASE_URL", "http://127.0.0.1:9"),
                             api_key="sk-test", max_retries=0)
client.messages.create(model="claude-sonnet-4-6", max_tokens=50, messages=[
    {{"role": "user", "content": "hi " + EVIL + os.environ.get("ASK", "a")}}])
lookup("q " + EVIL)
'''
# what a terminal acts on: ESC, BEL, the C1 form of ESC [ and a bidirectional override
ACTED_ON = ("\x1b", "\x07", "\x9b", "\u202e")


def test_reports_write_a_recorded_prompts_controls_as_escapes(
        tmp_path: Path, stub: Callable[[dict], Any]) -> None:
    """A divergence's diff, ``deja diff`` and a fork's document print what the agent sent
    and got, ``deja show`` and ``deja verify`` a header's run and time; terminal controls
    in them are printed as escapes, and a fork's document is still JSON of the same
    value."""
    evil = "\x1b[31mred\x1b[0m \x1b]0;title\x07 \u202eevil \x9b1m"
    program = tmp_path / "agent.py"
    program.write_text(AGENT.format(evil=evil))
    server = stub({"default": {"text": "answer " + evil}})
    runs = {}
    for ask in ("a", "b"):
        runs[ask] = tmp_path / f"{ask}.jsonl"
        done = _deja("record", "-o", runs[ask], "--", sys.executable, program,
                     env={"ANTHROPIC_BASE_URL": server.url, "ASK": ask})
        assert done.returncode == 0, done.stderr

    docs = [json.loads(raw) for raw in runs["a"].read_bytes().splitlines()]
    docs[0].update(run="r_" + evil, created="2026" + evil)  # signed with this machine's key
    hostile = tmp_path / "header.jsonl"
    hostile.write_bytes(join(resign(docs, TEST_KEY.encode())))

    outputs = {
        "replay": _deja("replay", runs["a"], env={"ASK": "b"}),  # the prompt changed
        "diff": _deja("diff", runs["a"], runs["b"]),
        "fork": _deja("fork", runs["a"], "--at", "1", "--show-document"),
        "show": _deja("show", hostile),  # the header's run and time, above the table
        "verify": _deja("verify", hostile),
    }
    assert outputs["replay"].returncode == 1 and "DIVERGED" in outputs["replay"].stdout
    assert outputs["diff"].returncode == 1
    for name in ("fork", "show", "verify"):
        assert outputs[name].returncode == 0, (name, outputs[name].stderr)
    assert "run r_\\x1b[31mred" in outputs["show"].stdout
    for name, done in outputs.items():
        both = done.stdout + done.stderr
        assert not [c for c in ACTED_ON if c in both], (name, both)
    assert "\\u202eevil" in outputs["replay"].stdout  # the diff shows the prompts
    assert "\\u202eevil" in outputs["diff"].stdout
    assert json.loads(outputs["fork"].stdout) == {"result": "result " + evil}
