"""A cassette's text in deja's tables is shown as it is: never read as rich's markup or
emoji codes, and never handed to the terminal as a control sequence.

A tool's name, its error, a run's labels and a folder's name are data: ``[/]`` in one used
to stop ``deja show`` and ``deja ls`` with rich's MarkupError traceback, ``[prod]`` was
left out of the table, ``:skull:`` drawn as an emoji and an escape sequence (colours, a
terminal's title, a hyperlink) passed through to the terminal. The commands run as a user
runs them, in their own process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import recorder

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


def _deja(*args: str | Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "400", "NO_COLOR": "1"}
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
