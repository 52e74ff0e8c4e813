"""deja diff of many runs: a column per run, a row per step, aligned by what steps mean.

Four runs of one agent are recorded with the real anthropic SDK against the stub server:
A, the base; B, the same behaviour recorded again (fresh ids and timings); C, which calls
one more tool (an audit it does not tell the model about) after its first search; D,
whose second search finds something else. C's extra step is one row of its own and every
step after it stays aligned with A's; D differs in place, at its second search.
"""

from __future__ import annotations

import json
import random
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest
from click.testing import CliRunner, Result
from conftest import MODEL, _collect_clients

import recorder
from deja.cli import main as cli
from recorder.cassette import load
from recorder.testing.server import StubServer
from replayer.diff import _shortest_edits, align_keys, compare
from replayer.diff_many import compare_many

if str(Path(__file__).parent) not in sys.path:  # loaded by path, from the viewer's tests
    sys.path.append(str(Path(__file__).parent))
from test_diff import PROMPT, SCRIPT, TOOLS  # the agent's prompt, tool and model script

FOUND = {"session refresh": ["auth/session.py"], "auth/": ["auth/session.py", "auth/token.py"]}


@recorder.tool
def find(query: str) -> list[str]:
    return FOUND[query]


@recorder.tool
def audit(query: str) -> str:
    return f"audited {query}"


def agent(base_url: str, *, audit_first: bool = False) -> str:
    """The tool loop; ``audit_first``: audit the first search's query once it is done
    (a step more, whose result the model never sees)."""
    client = anthropic.Anthropic(base_url=base_url, api_key="sk-test", max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": PROMPT}]
    for turn in range(5):
        reply = client.messages.create(model=MODEL, max_tokens=256, tools=TOOLS,
                                       messages=messages)
        messages.append({"role": "assistant",
                         "content": [b.model_dump(exclude_none=True) for b in reply.content]})
        if reply.stop_reason != "tool_use":
            return reply.content[0].text
        calls = [b for b in reply.content if b.type == "tool_use"]
        results = [json.dumps(find(**b.input)) for b in calls]
        if audit_first and turn == 0:
            audit(calls[0].input["query"])
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": b.id, "content": result}
            for b, result in zip(calls, results, strict=True)]})
    return "out of turns"


def record_runs(folder: Path) -> list[Path]:
    """A, B, C and D of the module's docstring, in ``folder``; the caller has set the
    signing key and the key home."""
    paths = [folder / f"{name}.jsonl" for name in ("a", "b", "c", "d")]
    for path in paths:
        changed = path.stem == "d"
        if changed:
            FOUND["auth/"] = ["auth/refresh.py"]
        try:
            with StubServer(SCRIPT) as server, recorder.record(path):
                agent(server.url, audit_first=path.stem == "c")
        finally:
            FOUND["auth/"] = ["auth/session.py", "auth/token.py"]
        _collect_clients()  # the agent's client, with its pooled connection to a stopped stub
    return paths


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, module_env: dict[str, str]
         ) -> Iterator[list[Path]]:
    with pytest.MonkeyPatch.context() as mp:
        for name in ("DEJA_HOME", "DEJA_KEY"):
            mp.setenv(name, module_env[name])
        yield record_runs(tmp_path_factory.mktemp("many"))


def diff(*paths: Path | str) -> Result:
    return CliRunner().invoke(cli, ["diff", *map(str, paths)])


def table(output: str) -> dict[str, list[str]]:
    """The rows of ``deja diff``'s table by their number (``"2*"``: a row that differs),
    each as its cells: columns are two spaces apart or more, a cell has single spaces."""
    rows = {}
    for line in output.splitlines():
        found = re.match(r"^\s*(\d+[* ])\s\s(.*)$", line)
        if found:
            rows[found.group(1).strip()] = re.split(r"\s{2,}", found.group(2).strip())
    return rows


def test_four_runs_with_one_inserted_step_stay_aligned(runs: list[Path]) -> None:
    result = diff(*runs)
    assert result.exit_code == 1, result.output
    ids = [load(p).run for p in runs]
    out = result.output
    assert f"A {ids[0]} (5 steps) {runs[0]}: the base" in out
    assert f"B {ids[1]} (5 steps) {runs[1]}: the same as A" in out
    assert f"C {ids[2]} (6 steps) {runs[2]}: first divergence at row 2: its step 2, " \
           "which A has not" in out
    assert f"D {ids[3]} (5 steps) {runs[3]}: first divergence at row 4: step 3" in out
    assert "rows 0-1: the same in every run (2 rows)" in out
    rows = table(out)
    model = f"model {MODEL}"
    # C's audit is a row of its own; every step after it lines up with A's, one seq on.
    assert rows["2*"] == ["—", "—", ">2 tool audit", "—"]
    assert rows["3"] == [f"2 {model}", f"2 {model}", f"3 {model}", f"2 {model}"]
    assert rows["4*"] == ["3 tool find", "3 tool find", "4 tool find", ">3 tool find"]
    assert rows["5*"] == [f"4 {model}"] * 2 + [f"5 {model}", f"4 {model}"]
    assert rows["6*"] == ["end completed"] * 4  # C's totals count its extra tool call
    assert set(rows) == {"2*", "3", "4*", "5*", "6*"}
    # The changed fields are listed under their row, the base's value first.
    assert '        D /result/0: "auth/session.py" -> "auth/refresh.py"' in out
    assert "[message 4 (user): tool result of find]" in out  # D's next request has it
    assert "        C /totals/tool_calls: 2 -> 3" in out
    header = next(line for line in out.splitlines() if line.startswith(" row"))
    assert [c.split()[0] for c in re.split(r"\s{2,}", header.strip())[1:]] == list("ABCD")


def test_json_has_runs_rows_and_first_divergences(runs: list[Path]) -> None:
    result = CliRunner().invoke(cli, ["diff", *map(str, runs), "--json"])
    assert result.exit_code == 1, result.output
    data = json.loads(result.output)
    assert set(data) == {"runs", "rows", "first_divergence", "same", "signatures"}
    assert [r["tag"] for r in data["runs"]] == list("ABCD")
    assert [r["steps"] for r in data["runs"]] == [5, 5, 6, 5]
    assert data["first_divergence"]["B"] is None
    assert data["first_divergence"]["C"] == {"row": 2, "seq": 2, "base_seq": None}
    assert data["first_divergence"]["D"] == {"row": 4, "seq": 3, "base_seq": 3}
    inserted = data["rows"][2]
    assert inserted["cells"][:2] == [None, None] and inserted["cells"][3] is None
    assert inserted["cells"][2] == {"seq": 2, "kind": "tool", "name": "audit", "status": "ok"}
    assert [c["op"] for c in inserted["changed"]["C"]] == ["added"]
    after = data["rows"][3]
    assert after["same"] and [c["seq"] for c in after["cells"]] == [2, 2, 3, 2]
    changed = data["rows"][4]["changed"]
    assert list(changed) == ["D"] and changed["D"][0]["path"] == "/result/0"
    assert all(note.startswith("verified") for note in data["signatures"].values())


def test_two_runs_align_by_meaning_too(runs: list[Path]) -> None:
    """``deja diff A C``: the inserted step is only in C and nothing after it differs but
    the end line, where position by position every step after it would."""
    a, _, c, _ = runs
    result = diff(a, c)
    assert result.exit_code == 1, result.output
    assert "steps 0-1: identical (2 steps)" in result.output
    assert "first divergence: step 2" in result.output
    assert "only in B: 1 step(s), 2 tool" in result.output
    data = json.loads(CliRunner().invoke(cli, ["diff", str(a), str(c), "--json"]).output)
    assert [(s["seq"], s["seq_a"], s["kind_a"], s["kind_b"]) for s in data["steps"]] == [
        (2, None, None, "tool"), (6, 5, "end", "end")]
    by_position = compare(load(a), load(c))  # what drift and the old diff pair: every step
    assert [s.seq for s in by_position.steps] == [2, 3, 4, 5, 6]  # after the insertion
    assert diff(a, runs[1]).exit_code == 0


def test_many_runs_that_mean_the_same_exit_0(runs: list[Path]) -> None:
    a, b = runs[:2]
    result = diff(a, b, a)
    assert result.exit_code == 0, result.output
    assert "same: every step means the same in every run" in result.output
    many = compare_many([load(a), load(b), load(a)])
    assert many.same and many.same_prefix == len(many.rows) == 6


def test_a_run_of_its_own_is_refused(runs: list[Path]) -> None:
    result = diff(runs[0])
    assert result.exit_code == 2
    assert "at least two cassettes" in result.output


def test_keys_align_an_insertion_a_change_in_place_and_a_deletion() -> None:
    """The aligner alone: finest keys first, then coarser ones, then by position."""
    def levels(steps: str) -> list[list[str]]:  # "Tx" is step T with content x
        return [list(steps.split()), [s[0] for s in steps.split()]]

    base = levels("Ma Tb Mc Td Me")
    inserted = levels("Ma Tb Xz Mc Td Me")
    assert align_keys(base, inserted) == [(0, 0), (1, 1), (None, 2), (2, 3), (3, 4), (4, 5)]
    changed = levels("Ma Tq Mr Td Me")  # a changed tool result, and the call after it
    assert align_keys(base, changed) == [(0, 0), (1, 1), (2, 2), (3, 3), (4, 4)]
    deleted = levels("Ma Mc Td Me")
    assert align_keys(base, deleted) == [(0, 0), (1, None), (2, 1), (3, 2), (4, 3)]
    other = levels("Ya Zb")  # nothing in common: paired in place, the rest alone
    assert align_keys(levels("Ma Tb Mc"), other) == [(0, 0), (1, 1), (2, None)]


def test_a_long_run_with_one_inserted_step_stays_aligned() -> None:
    """Four thousand steps, a tool call repeated with the same result between model calls
    whose conversation grows: after one inserted step no model call means the same any
    more, and the kind and name of every step repeat; the steps still line up, quickly."""
    n = 4000
    base = [[f"model {i}" if i % 2 == 0 else "tool" for i in range(n)],
            ["model" if i % 2 == 0 else "tool" for i in range(n)]]
    fixed = [list(level) for level in base]
    for level in fixed:
        level.insert(1000, "audit")
    fixed[0] = [k + " (longer)" if i > 1000 and k != "tool" else k
                for i, k in enumerate(fixed[0])]
    started = time.monotonic()
    pairs = align_keys(base, fixed)
    assert time.monotonic() - started < 5
    assert pairs == [(i, i) for i in range(1000)] + [(None, 1000)] + [
        (i, i + 1) for i in range(1000, n)]


def test_the_shortest_edits_of_a_long_stretch_are_a_longest_common_subsequence() -> None:
    """Myers' algorithm, which aligns the long stretches, against the textbook dynamic
    programme, on sequences of few keys (where ties abound)."""
    chooser = random.Random(7)
    for _ in range(500):
        a = [chooser.choice("mtx") for _ in range(chooser.randint(0, 14))]
        b = [chooser.choice("mtx") for _ in range(chooser.randint(0, 14))]
        ops = _shortest_edits(a, b, len(a) + len(b))
        assert ops is not None
        assert [(op[1], op[3]) for op in ops[1:]] == [(op[2], op[4]) for op in ops[:-1]]
        assert not ops or (ops[0][1], ops[0][3], ops[-1][2], ops[-1][4]) == (
            0, 0, len(a), len(b))
        assert all(a[i1:i2] == b[j1:j2] for tag, i1, i2, j1, j2 in ops if tag == "equal")
        longest = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
        for i in range(len(a) - 1, -1, -1):
            for j in range(len(b) - 1, -1, -1):
                longest[i][j] = longest[i + 1][j + 1] + 1 if a[i] == b[j] else max(
                    longest[i + 1][j], longest[i][j + 1])
        assert sum(op[2] - op[1] for op in ops if op[0] == "equal") == longest[0][0]
    assert _shortest_edits(list("mmmm"), list("tttt"), 3) is None  # 8 edits: too many
