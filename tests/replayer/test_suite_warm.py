"""deja suite starts its incidents warm (forks of one process that imported deja and the
SDKs once) unless told --cold; the verdicts are the same either way.

The incident is a real recording of a program that uses only a deja tool and says on
standard error whether the OpenAI SDK was imported before it ran: it never imports it,
so only a warm start (which preloads it) shows it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PROGRAM = '''\
import json, sys
print("preloaded", json.dumps("openai" in sys.modules), file=sys.stderr)
import recorder

@recorder.tool
def add(a: int, b: int) -> int:
    return a + b

print("sum", add(2, 3))
'''


def _deja(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "deja", *args], cwd=cwd, text=True,
                          capture_output=True, timeout=300, env={**os.environ})


@pytest.fixture
def incidents(tmp_path: Path, deja_home: Path) -> Path:
    (tmp_path / "prog.py").write_text(PROGRAM)
    folder = tmp_path / "incidents"
    done = _deja("record", "-o", "incidents/one.jsonl", "--", "python", "prog.py",
                 cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    shutil.copyfile(folder / "one.jsonl", folder / "two.jsonl")
    return folder


@pytest.mark.parametrize("cold", [False, True], ids=["warm", "cold"])
def test_incidents_start_warm_unless_cold_with_the_same_verdicts(incidents: Path,
                                                                  cold: bool) -> None:
    done = _deja("suite", "incidents", "--inline", "--json", *(["--cold"] if cold else []),
                 cwd=incidents.parent)
    assert done.returncode == 0, done.stderr
    records = json.loads(done.stdout)["incidents"]
    assert [r["verdict"] for r in records] == ["identical", "identical"]
    for record in records:
        assert f"preloaded {json.dumps(not cold)}" in record["output"], record["output"]
