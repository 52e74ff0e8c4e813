"""A signed line of a shape deja never writes is refused by name, never a traceback.

deja's writer checks each line's field types before it signs it, but a signature is only
as sound as whatever held the key: a line re-signed with it after an edit (a
``"response": null``, a request's ``"base": true``) is no line deja wrote. Such a line used
to reach ``deja show``, ``deja ls``, ``deja status``, ``deja diff`` and the viewer's index
as an AttributeError or a TypeError from deep inside them (``deja status`` reads a
run's counts alone, not the requests). The field types are now
checked on every line at load, and a line found malformed only when a command restores
it (response headers that refer to more of an earlier line's than it has) is said by the
command, exit status 2, or shown by the index as that run's error. The commands run as a
user runs them, in their own process.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from recorder.cassette import load
from recorder.cassette.keys import Keyring, key_id
from recorder.errors import CorruptCassette
from tests.conftest import TEST_KEY
from tests.tamper import dump, join, resign
from viewer.index import read_rows

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "v2_tool_agent.jsonl"
# its lines: 0 the header, 1 an effect, 2 a model call, 3 a tool, 4 a model call whose
# request refers to the one of line 2 (base/keep), 5 the end line


def _mutant(out: Path, line: int, path: tuple[str, ...], value: Any) -> Path:
    """The golden run with one field of one line set to ``value``, every line signed
    again with this machine's key: it verifies."""
    docs = [json.loads(raw) for raw in GOLDEN.read_bytes().splitlines()]
    target = docs[line]
    for name in path[:-1]:
        target = target[name]
    target[path[-1]] = value
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(join(resign(docs, TEST_KEY.encode())))
    return out


def _deja(*args: str | Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "300", "NO_COLOR": "1"}
    return subprocess.run([sys.executable, "-m", "deja", *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(("line", "path", "value", "named"), [
    (4, ("response",), None, "seq 3 (model): 'response' must be an object, not NoneType"),
    (2, ("response", "status"), None, "seq 1 (model) response: 'status' must be an integer"),
    (2, ("cost_usd",), "x", "seq 1 (model): 'cost_usd' must be"),
    (3, ("ms",), True, "seq 2 (tool): 'ms' must be"),
    (5, ("totals",), True, "seq 4 (end): 'totals' must be an object or null, not bool"),
    (5, ("totals", "duration_s"), 2**64, "seq 4 (end): the totals must be numbers"),
    (5, ("totals", "duration_s"), {}, "seq 4 (end): the totals must be numbers"),
    (4, ("request", "base"), True, "seq 3 (model) request: 'base' must be an integer"),
    (4, ("request", "reply"), 3, "seq 3 (model): its request's 'reply' names seq 3, not a"),
    (3, ("ms",), float("inf"), "Infinity is not JSON deja writes"),  # orjson refuses it
    (2, ("seq",), True, "has seq True, expected 1"),  # true == 1 in Python: no seq here
])
def test_a_signed_line_of_a_type_deja_never_writes_is_refused_at_load(
        tmp_path: Path, line: int, path: tuple[str, ...], value: Any, named: str) -> None:
    mutant = _mutant(tmp_path / "m.jsonl", line, path, value)
    with pytest.raises(CorruptCassette) as raised:
        load(mutant, keyring=Keyring.of(TEST_KEY))
    assert named in str(raised.value)
    assert raised.value.seq == line - 1


@pytest.mark.parametrize("body", ["x", "caf\u00e9"])
def test_a_signed_body_said_to_be_base64_that_is_not_is_refused_at_load(
        tmp_path: Path, body: str) -> None:
    """A Bedrock reply's event stream is stored as base64; one that does not decode is
    refused by name, not a binascii.Error in the index, ``deja diff`` or the replay."""
    golden = GOLDEN.with_name("v2_bedrock_agent.jsonl")
    docs = [json.loads(raw) for raw in golden.read_bytes().splitlines()]
    [line] = [n for n, d in enumerate(docs) if d.get("response", {}).get("encoding") == "base64"]
    docs[line]["response"]["body"] = body
    mutant = tmp_path / "m.jsonl"
    mutant.write_bytes(join(resign(docs, TEST_KEY.encode())))
    with pytest.raises(CorruptCassette, match="its body is not base64") as raised:
        load(mutant, keyring=Keyring.of(TEST_KEY))
    assert raised.value.seq == line - 1


def test_a_signed_line_with_a_lone_surrogate_is_refused_at_load(tmp_path: Path) -> None:
    """orjson refuses the escape of a surrogate with no pair; the line then goes through
    the strict decoder, which refuses it too (it used to read it)."""
    docs = [json.loads(raw) for raw in GOLDEN.read_bytes().splitlines()]
    docs[3]["result"]["sky"] = "@@here@@"
    docs[0]["key_id"] = key_id(TEST_KEY.encode())
    lines, prev = [], ""
    for doc in docs:  # signed as the writer signs: the bytes without the sig, chained
        body = dump({k: v for k, v in doc.items() if k != "sig"}).replace(b"@@here@@",
                                                                          b"cl\\ud800ear")
        prev = base64.urlsafe_b64encode(hmac.digest(
            TEST_KEY.encode(), prev.encode("ascii") + body, hashlib.sha256)).rstrip(b"=").decode()
        lines.append(body[:-1] + f',"sig":"{prev}"}}'.encode())
    mutant = tmp_path / "m.jsonl"
    mutant.write_bytes(join(lines))
    with pytest.raises(CorruptCassette) as raised:
        load(mutant, keyring=Keyring.of(TEST_KEY))
    assert "lone surrogate" in str(raised.value) and raised.value.seq == 2


def test_a_line_found_malformed_when_restored_is_said_by_every_command(tmp_path: Path
                                                                      ) -> None:
    folder = tmp_path / "runs"
    # response headers as the edits of line 2's, but more of them than it has
    mutant = _mutant(folder / "bad.jsonl", 4, ("response", "headers"), [None] * 9)
    good = folder / "good.jsonl"
    good.write_bytes(join(resign([json.loads(raw) for raw in
                                  GOLDEN.read_bytes().splitlines()], TEST_KEY.encode())))
    load(mutant, keyring=Keyring.of(TEST_KEY))  # it loads: the line is restored later

    for args in (("show", mutant), ("diff", good, mutant), ("verify", mutant)):
        done = _deja(*args)
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        assert "Traceback" not in done.stderr, done.stderr
        assert "CorruptCassette" in done.stderr and "seq 3" in done.stderr, done.stderr
        assert not done.stdout.lstrip().startswith("{"), done.stdout  # JSON if asked only

    shown = _deja("show", mutant, "--json")  # JSON on stdout, as for a load's error
    assert shown.returncode == 2, shown.stderr
    said = json.loads(shown.stdout)
    assert (said["ok"], said["error"], said["path"]) == (False, "CorruptCassette", str(mutant))
    assert "seq 3" in said["message"]

    listed = _deja("ls", folder, "--json")  # the folder is listed, the bad run as an error
    assert listed.returncode == 0, listed.stderr
    rows = {Path(r["path"]).name: r for r in json.loads(listed.stdout)}
    assert rows["good.jsonl"]["status"] == "completed"
    assert rows["bad.jsonl"]["status"] == "error"
    assert "CorruptCassette" in rows["bad.jsonl"]["error"]
    assert "seq 3" in rows["bad.jsonl"]["error"]

    row, steps = read_rows(mutant, Keyring.of(TEST_KEY), False)
    assert (row["status"], steps) == ("error", [])


def test_a_replay_that_meets_a_line_found_malformed_says_so_and_fails(tmp_path: Path
                                                                      ) -> None:
    """The agent is served the error where the line is restored (it fails closed, as on a
    divergence), and ``deja replay`` ends with it, exit status 2: its report, not a
    traceback from its own bookkeeping after the program."""
    mutant = _mutant(tmp_path / "bad.jsonl", 4, ("response", "headers"), [None] * 9)
    program = tmp_path / "run_agent.py"
    program.write_text(f"import sys\nsys.path.insert(0, {str(GOLDEN.parent)!r})\n"
                       "from agent import agent\nprint(agent('http://127.0.0.1:9'))\n")
    done = _deja("replay", mutant, "--", sys.executable, program)
    assert done.returncode == 2, (done.stdout, done.stderr)
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: CorruptCassette:") and "seq 3" in last, done.stderr
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr
    asked = _deja("replay", mutant, "--json", "--", sys.executable, program)
    assert asked.returncode == 2, asked.stderr
    said = json.loads(asked.stdout)  # JSON on stdout, as for a cassette refused at load
    assert (said["ok"], said["error"], said["path"]) == (False, "CorruptCassette", str(mutant))

    quiet = tmp_path / "nothing.py"  # a program that makes no call: the lines are unused
    quiet.write_text("print('no call')\n")
    done = _deja("replay", mutant, "--", sys.executable, quiet)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr and "CorruptCassette" in done.stderr, done.stderr


def test_a_request_that_does_not_rebuild_is_refused_before_anything_is_served(
        tmp_path: Path) -> None:
    """A model line's request is rebuilt when something first needs it (a replay's
    index, its fingerprint, the whole line), not at load. A signed line whose request
    resends a reply in a shape no earlier line holds still loads, and its run's counts are
    read; every command that needs the request refuses it by name, a replay before the
    program starts, and ``deja repair`` writes nothing."""
    mutant = _mutant(tmp_path / "bad.jsonl", 4, ("request", "shape"), 7)
    before = mutant.read_bytes()
    cassette = load(mutant, keyring=Keyring.of(TEST_KEY))
    for _ in range(2):  # and again: a pass that failed is not taken as done
        with pytest.raises(CorruptCassette, match="KeyError") as raised:
            cassette.observations.heads  # noqa: B018
        assert raised.value.seq == 3
    assert _deja("status", mutant).returncode == 0

    for args in (("verify", mutant), ("show", mutant), ("repair", mutant)):
        done = _deja(*args)
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        assert "Traceback" not in done.stderr and "seq 3" in done.stderr, done.stderr
    assert mutant.read_bytes() == before

    program = tmp_path / "agent.py"
    program.write_text("print('the program ran')\n")
    done = _deja("replay", mutant, "--", sys.executable, program)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "the program ran" not in done.stdout
    assert "CorruptCassette" in done.stderr and "seq 3" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_the_golden_run_signed_again_reads_as_it_is(tmp_path: Path) -> None:
    """The mutants above differ from a run that reads by their one field alone."""
    copy = tmp_path / "good.jsonl"
    shutil.copyfile(GOLDEN, copy)
    same = _mutant(tmp_path / "same.jsonl", 4, ("request", "base"), 1)
    for path, key in ((copy, "golden-key-deja-v1"), (same, TEST_KEY)):
        row, steps = read_rows(path, Keyring.of(key), False)
        assert row["status"] == "completed", row
        assert [s["kind"] for s in steps] == ["effect", "model", "tool", "model"]


def test_a_programs_own_bug_in_a_handler_keeps_its_traceback(tmp_path: Path) -> None:
    """Only a CorruptCassette the program's error was raised from is deja's to say in one
    line; a bug the program hit while it handled one stays the program's, traceback and
    all."""
    golden = _mutant(tmp_path / "golden.jsonl", 1, ("name",), "uuid")  # as it was, re-signed
    program = tmp_path / "own_bug.py"
    program.write_text("from recorder.errors import CorruptCassette\n"
                       "try:\n    raise CorruptCassette('its own')\n"
                       "except CorruptCassette:\n    defualts\n")
    done = _deja("replay", golden, "--", sys.executable, program)
    assert done.returncode == 1, (done.stdout, done.stderr)  # diverged: no call was made
    assert "Traceback" in done.stderr and "NameError: name 'defualts'" in done.stderr
