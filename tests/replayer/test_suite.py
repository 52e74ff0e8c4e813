"""``deja suite`` run inline: a changed program against a folder of recorded incidents, a
verdict each, the table, ``--json``, the JUnit report, annotations and the exit status;
a suite run again under its id; and the pytest marker over a folder.

The incidents (``tests/suite_incidents.py``) are one order agent's four behaviours,
recorded once for the module with ``deja record`` against the stub server and copied
under other names (a copy keeps its signature). Every suite is ``python -m deja suite``,
a real process whose incidents are real processes.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import xmlschema
from suite_incidents import (
    BEHAVIOURS,
    check_the_fix,
    deja,
    make_incidents,
    record_project,
    suite_env,
)

from recorder.cassette import load
from replayer import suite_summary

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "tests" / "cli" / "junit-10.xsd"
ONE_EACH = ("nothing", "refund-30", "refund-all", "refund-0")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory, module_env: dict[str, str]) -> Path:
    return record_project(tmp_path_factory.mktemp("suite") / "project", module_env)


@pytest.fixture
def project(recorded: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(recorded, tmp_path / "project"))


def env(**extra: str) -> dict[str, str]:
    import os

    return suite_env(dict(os.environ), **extra)


def table(stdout: str) -> dict[str, list[str]]:
    """The verdict table's rows by incident: their cells, stripped."""
    found = {}
    for line in stdout.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("│").split("│")]
        if len(cells) > 3 and cells[0].endswith(".jsonl"):
            found[cells[0]] = cells
    return found


def test_a_fix_that_fixes_three_and_breaks_one_reports_exactly_those(project: Path) -> None:
    made = make_incidents(project)
    done = deja("suite", "incidents", "--inline", "-j", "2", "--then", "stub", "live.stub.json",
                "-o", "out", "--json", "--junit", "reports/suite.xml", "--", "python",
                "fixed.py", cwd=project, env=env())
    assert done.returncode == 1, done.stderr[-3000:]
    document = json.loads(done.stdout)
    check_the_fix(document, made, project / "out")
    assert document["where"] == "inline"
    assert [r["incident"] for r in document["incidents"]] == sorted(made)
    assert all(r["cassette"] == f"incidents/{r['incident']}" for r in document["incidents"])
    assert done.stderr.count("deja suite: [") == 20
    assert "ValueError: a refund of nothing" in done.stderr  # under the one that now fails
    schema = xmlschema.XMLSchema(str(SCHEMA))
    schema.validate(str(project / "reports" / "suite.xml"))
    [suite] = schema.to_dict(str(project / "reports" / "suite.xml"))["testsuite"]
    assert (suite["@name"], suite["@tests"], suite["@failures"], suite["@errors"]) == (
        "deja suite", "20", "1", "0")
    [failed] = [case for case in suite["testcase"] if "failure" in case]
    assert failed["@name"] == "07-refund-0.jsonl" and failed["@classname"] == "incidents"
    assert failed["failure"][0]["@type"] == "Regression"
    # the summary it left with its new cassettes, for deja view out
    [path] = (project / "out" / ".deja" / "suites").glob("*.json")
    summary = suite_summary.read(path)
    assert path.stem == summary["suite"] == document["suite"]
    assert (summary["kind"], summary["mode"], summary["where"]) == ("suite", "then stub", "inline")
    assert summary["command"] == ["python", "fixed.py"]
    assert (summary["folder"], summary["output"]) == (str((project / "incidents").resolve()),
                                                      str((project / "out").resolve()))
    assert summary["totals"] == document["summary"]
    entries = {e["incident"]: e for e in summary["incidents"]}
    for record in document["incidents"]:
        entry = entries[record["incident"]]
        assert entry["cassette"] == str((project / record["cassette"]).resolve())
        assert entry["new_cassette"] == str((project / record["new_cassette"]).resolve())
        assert entry["new_run"] == load(project / record["new_cassette"]).run
        assert {k: entry[k] for k in ("run", "verdict", "changed_at", "change", "live")} == {
            k: record[k] for k in ("run", "verdict", "changed_at", "change", "live")}


def test_plain_replays_judge_by_the_recording_and_a_divergence_is_a_regression(
        project: Path) -> None:
    made = make_incidents(project, ONE_EACH)
    same = deja("suite", "incidents", "-j", "2", "--inline", "--", "python", "agent.py",
                cwd=project, env=env())
    assert same.returncode == 0, same.stderr[-3000:]
    rows = table(same.stdout)
    assert list(rows) == sorted(made)
    # incident, recorded, now, verdict, live calls, cost, seconds; nothing new written
    assert rows["00-nothing.jsonl"][1:6] == ["completed", "completed", "identical", "0",
                                             "$0.000000"]
    assert rows["02-refund-all.jsonl"][1:4] == ["failed, exit 1", "failed, exit 1",
                                                "identical"]  # still failing: no regression
    assert re.search(r"^total: 4 incidents: 4 identical, .* exit status 0$", same.stdout, re.M)
    [path] = (project / "incidents" / ".deja" / "suites").glob("incidents-suite-*.json")
    summary = suite_summary.read(path)  # a plain replay's: beside its incidents
    assert summary["mode"] == "replay" and summary["output"] is None
    assert [(e["incident"], e["verdict"], e["new_cassette"]) for e in summary["incidents"]] == [
        (name, "identical", None) for name in sorted(made)]
    make_incidents(project, ("nothing",), folder="late")
    late = deja("suite", "late", "--inline", "--summary", "reports/late.json", "--", "python",
                "late.py", cwd=project, env=env(GITHUB_ACTIONS="true"))
    assert late.returncode == 1, late.stderr[-3000:]
    assert table(late.stdout)["00-nothing.jsonl"][2:4] == ["failed, exit 1", "now fails"]
    assert re.search(r"^::error file=late/00-nothing\.jsonl,line=\d+,title=deja suite%3A "
                     r"now fails::late/00-nothing\.jsonl \(run r_\w+\): now fails$",
                     late.stdout, re.M), late.stdout
    assert "summary in reports/late.json" in late.stderr
    [entry] = suite_summary.read(project / "reports" / "late.json")["incidents"]
    assert entry["verdict"] == "now_fails" and not (project / "late" / ".deja").exists()
    make_incidents(project, ("refund-all", "refund-0"), folder="changed")
    fixed = deja("suite", "changed", "--inline", "--json", "--", "python", "fixed.py",
                 cwd=project, env=env())
    assert fixed.returncode == 1
    records = json.loads(fixed.stdout)["incidents"]
    assert [(r["verdict"], r["changed_at"], r["change"]) for r in records] == [
        ("changed", 1, "extra_call"), ("changed", 1, "missing_call")]
    assert not list(project.glob("incidents-suite-*"))  # a plain replay writes nothing


def test_an_incident_that_cannot_be_judged_and_bad_input_exit_2(project: Path) -> None:
    make_incidents(project, ("nothing",))
    bad = project / "incidents" / "01-tampered.jsonl"
    text = (project / "incidents" / "00-nothing.jsonl").read_text()
    bad.write_text(text.replace("NOTHING", "NOTHINK", 1))
    done = deja("suite", "incidents", "--inline", "--json", "--", "python", "agent.py",
                cwd=project, env=env())
    assert done.returncode == 2, done.stderr[-3000:]
    records = {r["incident"]: r for r in json.loads(done.stdout)["incidents"]}
    assert records["00-nothing.jsonl"]["verdict"] == "identical"
    assert records["01-tampered.jsonl"]["verdict"] == "error"
    assert "SignatureError" in records["01-tampered.jsonl"]["error"]
    for args, said in ((["missing"], "is not a folder"),
                       (["incidents", "-o", "x"], "-o, --tool and --live-tool go with --then"),
                       (["incidents", "--then", "stub"], "--then stub needs the stub's script"),
                       (["incidents", "--id", "a b"], "a suite's id is"),
                       (["incidents", "--then", "live", "--tool", "x=maybe"], "x='maybe'")):
        ran = deja("suite", *args, "--inline", "--", "python", "agent.py", cwd=project,
                   env=env())
        assert ran.returncode == 2 and said in ran.stderr, (args, ran.stderr)
    assert not list(project.glob("incidents-suite-*")) and not (project / "x").exists()


def test_the_same_suite_again_judges_what_it_finished_and_replaces_what_it_left(
        project: Path) -> None:
    make_incidents(project, ("nothing", "refund-all"))
    args = ("suite", "incidents", "--inline", "--id", "fix-1", "--then", "stub",
            "live.stub.json", "--json", "--", "python", "fixed.py")
    first = deja(*args, cwd=project, env=env())
    assert first.returncode == 0, first.stderr[-3000:]
    out = project / "fix-1"  # the default OUTDIR: DIR/../<suite id>
    runs = {p.name: load(p).run for p in out.glob("*.jsonl")}
    assert sorted(runs) == ["00-nothing.jsonl", "01-refund-all.jsonl"]
    left = out / "01-refund-all.jsonl"  # as a worker that died mid-run leaves it
    left.write_text("".join(left.read_text().splitlines(keepends=True)[:-1]))
    again = deja(*args, cwd=project, env=env())
    assert again.returncode == 0, again.stderr[-3000:]
    records = {r["incident"]: r for r in json.loads(again.stdout)["incidents"]}
    assert [r["verdict"] for r in records.values()] == ["identical", "now_completes"]
    assert records["00-nothing.jsonl"]["reused"] is True
    assert load(out / "00-nothing.jsonl").run == runs["00-nothing.jsonl"]  # not run again
    replaced = load(left)
    assert replaced.run != runs["01-refund-all.jsonl"] and replaced.end is not None
    assert "was finished by an earlier attempt" in records["00-nothing.jsonl"]["output"]
    assert "was left unfinished by an earlier attempt" in \
        records["01-refund-all.jsonl"]["output"]
    assert sorted(p.name for p in out.glob("*.jsonl")) == sorted(runs)
    [path] = (out / ".deja" / "suites").iterdir()  # replaced whole, under the suite's id
    assert path.name == "fix-1.json"
    assert [e["new_run"] for e in suite_summary.read(path)["incidents"]] == [
        load(out / name).run for name in sorted(runs)]


def test_the_pytest_marker_makes_a_case_of_each_incident(
        recorded: Path, pytester: pytest.Pytester) -> None:
    incidents = pytester.path / "incidents"
    incidents.mkdir()
    for name in BEHAVIOURS:
        shutil.copyfile(recorded / "recorded" / f"{name}.jsonl", incidents / f"{name}.jsonl")
    pytester.makepyfile(test_incidents=f"""
        import runpy
        import pytest

        @pytest.mark.deja_suite("incidents")
        def test_agent(deja_incident):
            assert deja_incident.parent.name == "incidents"
            runpy.run_path({str(recorded / "agent.py")!r}, run_name="__main__")

        @pytest.mark.deja_suite("incidents")
        def test_fixed():
            runpy.run_path({str(recorded / "fixed.py")!r}, run_name="__main__")
    """)
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-v")
    # the agent as recorded: the incident that crashed still crashes; the fix diverges
    # from the two recordings whose calls it changes
    result.assert_outcomes(passed=5, failed=3)
    result.stdout.fnmatch_lines(["*test_agent?nothing? PASSED*",
                                 "*test_agent?refund-all? FAILED*",
                                 "*test_fixed?refund-0? FAILED*",
                                 "*test_fixed?refund-all? FAILED*"])
    result.stdout.fnmatch_lines(["*ValueError: invalid literal for int()*"])
    result.stdout.fnmatch_lines(["*replay of r_*DIVERGED*"])
