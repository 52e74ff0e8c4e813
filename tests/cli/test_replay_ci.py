"""``deja replay`` of many cassettes in one command, for CI: the summary table and the exit
status of the lot, ``--json`` of them all, the JUnit XML report (validated against the
Jenkins xUnit schema pytest checks its own reports with), and GitHub Actions annotations
that point at the diverging line of the cassette.

A three-call agent is recorded once for the module through ``deja record``, against the
stub server, three times: ``same.jsonl`` (replays identical), ``volatile.jsonl`` (recorded
with another user id in the request's metadata, which the Anthropic provider declares
volatile: replays equivalent) and ``changed,100%.jsonl`` (recorded from ``changed.py``,
whose second prompt is then edited: diverges at step 1, with a name a GitHub annotation
must escape). Each test replays copies of them in a project of its own.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import xmlschema

from recorder.testing.server import StubServer
from replayer.ci import Outcome, annotation

HERE = Path(__file__).parent
SCHEMA = HERE / "junit-10.xsd"
CHANGED = "changed,100%.jsonl"
AGENT = '''\
import os, anthropic
PROMPTS = ["Plan the trip.", "Book the train.", "Summarise it."]
client = anthropic.Anthropic(max_retries=0)
messages = []
for prompt in PROMPTS:
    messages.append({"role": "user", "content": prompt})
    reply = client.messages.create(model="claude-sonnet-4-6", max_tokens=64, messages=messages,
                                   metadata={"user_id": os.environ.get("AGENT_USER", "u-1")})
    messages.append({"role": "assistant", "content": reply.content[0].text})
print("done")
'''


def deja(*args: str, cwd: Path, env: dict[str, str] | None = None
         ) -> subprocess.CompletedProcess[str]:
    """``deja ARGS`` as a user runs it, outside GitHub Actions unless ``env`` says so."""
    base = {k: v for k, v in os.environ.items() if k not in ("GITHUB_ACTIONS", "AGENT_USER")}
    return subprocess.run([sys.executable, "-m", "deja", *args], cwd=cwd, text=True,
                          capture_output=True, timeout=300, env={**base, **(env or {})})


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory, module_env: dict[str, str]) -> Path:
    """The project with its three cassettes, recorded once for the module."""
    project = tmp_path_factory.mktemp("replay-ci")
    (project / "agent.py").write_text(AGENT)
    (project / "changed.py").write_text(AGENT)
    runs = [("same.jsonl", "agent.py", {}), ("volatile.jsonl", "agent.py", {"AGENT_USER": "u-2"}),
            (CHANGED, "changed.py", {})]
    with StubServer({"default": {"text": "Noted."}}) as server:
        for name, program, extra in runs:
            env = {**module_env, "ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_API_KEY": "sk-stub",
                   **extra}
            done = deja("record", "-o", f"cassettes/{name}", "--", "python", program,
                        cwd=project, env=env)
            assert done.returncode == 0, done.stdout + done.stderr
    # the deliberate change: the second prompt is another one
    (project / "changed.py").write_text(AGENT.replace("Book the train.", "Book a flight."))
    return project


@pytest.fixture
def project(recorded: Path, tmp_path: Path) -> Path:
    """A copy of the project, cassettes and programs where they were recorded."""
    return Path(shutil.copytree(recorded, tmp_path / "project"))


def tamper(project: Path, name: str = "bad.jsonl") -> Path:
    """A copy of same.jsonl with one recorded answer edited: its signature fails."""
    bad = project / "cassettes" / name
    lines = (project / "cassettes" / "same.jsonl").read_text().splitlines(keepends=True)
    assert "Noted." in lines[1]
    lines[1] = lines[1].replace("Noted.", "Nofed.", 1)
    bad.write_text("".join(lines))
    return bad


def rows(stdout: str) -> dict[str, list[str]]:
    """The summary table's rows by cassette: its cells, stripped."""
    found = {}
    for line in stdout.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("│").split("│")]
        if len(cells) == 6 and cells[0].startswith("cassettes/"):
            found[cells[0]] = cells
    return found


def validated(path: Path) -> dict:
    """The JUnit report at ``path``, checked against the schema, as a dict."""
    schema = xmlschema.XMLSchema(str(SCHEMA))
    schema.validate(str(path))
    return schema.to_dict(str(path))


def child(case: dict, name: str) -> dict:
    """A test case's one ``failure``, ``error`` or ``skipped`` element."""
    [element] = case[name]  # the schema lets a case hold many: a list
    return element


def cases(report: dict) -> list[dict]:
    [suite] = report["testsuite"]
    return suite["testcase"]


def test_three_cassettes_in_one_command_end_with_a_table_and_exit_1(project: Path) -> None:
    done = deja("replay", "cassettes/same.jsonl", "cassettes/volatile.jsonl",
                f"cassettes/{CHANGED}", "--junit", "reports/deja.xml", cwd=project)
    assert done.returncode == 1, done.stdout + done.stderr
    table = rows(done.stdout)
    assert list(table) == ["cassettes/same.jsonl", "cassettes/volatile.jsonl",
                           f"cassettes/{CHANGED}"], done.stdout
    same, volatile, changed = table.values()
    assert same[2:5] == ["identical", "3/3", ""] and same[1].startswith("r_")
    assert volatile[2:5] == ["equivalent", "3/3", ""]
    assert changed[2:5] == ["diverged", "1/3", "step 1 changed_request"]
    assert all(float(row[5]) > 0 for row in table.values())
    assert re.search(r"^total: 3 cassettes, 2 passed \(1 identical, 1 equivalent\), 1 "
                     r"diverged, 0 not judged, in [\d.]+s; exit status 1$", done.stdout, re.M)
    # each one's full report on stderr, the divergence's details with it; no annotation
    assert done.stderr.count("replay of r_") == 3
    assert "kind: changed_request (prompt)" in done.stderr
    assert "--- recorded" in done.stderr and "::error" not in done.stdout + done.stderr
    # the JUnit report: a case per cassette, the diverged one failed with its report
    report = validated(project / "reports" / "deja.xml")
    [suite] = report["testsuite"]
    assert (suite["@name"], suite["@tests"], suite["@failures"], suite["@errors"],
            suite["@skipped"]) == ("deja replay", "3", "1", "0", "0")
    assert [(c["@classname"], c["@name"]) for c in suite["testcase"]] == [
        ("cassettes", "same.jsonl"), ("cassettes", "volatile.jsonl"), ("cassettes", CHANGED)]
    failure = child(suite["testcase"][2], "failure")
    assert "diverged at step 1 (changed_request)" in failure["@message"]
    assert ": DIVERGED" in failure["$"] and "kind: changed_request (prompt)" in failure["$"]
    times = [float(c["@time"]) for c in suite["testcase"]]
    assert all(t > 0 for t in times)
    assert float(suite["@time"]) == pytest.approx(sum(times), abs=0.005)


def test_a_directory_of_passing_cassettes_exits_0(project: Path) -> None:
    (project / "cassettes" / CHANGED).unlink()
    done = deja("replay", "cassettes", "--", "python", "agent.py", cwd=project)
    assert done.returncode == 0, done.stdout + done.stderr
    assert list(rows(done.stdout)) == ["cassettes/same.jsonl", "cassettes/volatile.jsonl"]
    assert "2 passed (1 identical, 1 equivalent), 0 diverged, 0 not judged" in done.stdout
    assert "done" in done.stderr and "done" not in done.stdout  # the program's own output


@pytest.mark.parametrize("cold", [False, True], ids=["warm", "cold"])
def test_many_cassettes_start_their_programs_warm_unless_cold(project: Path, cold: bool) -> None:
    """Of many cassettes, each program is a fork of the replaying process, which has
    imported the SDK once: the program finds it imported before its own import. --cold
    starts each in a fresh interpreter, which has not."""
    (project / "cassettes" / CHANGED).unlink()
    (project / "probe.py").write_text(
        "import sys\nprint('sdk imported before the program:', 'anthropic' in sys.modules, "
        "file=sys.stderr)\n" + AGENT)
    done = deja("replay", "cassettes", *(["--cold"] if cold else []), "--", "python",
                "probe.py", cwd=project)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed (1 identical, 1 equivalent), 0 diverged, 0 not judged" in done.stdout
    said = re.findall(r"sdk imported before the program: (True|False)", done.stderr)
    assert said == [str(not cold)] * 2, done.stderr


def test_a_bad_cassette_among_good_ones_exits_2_and_the_others_are_replayed(
        project: Path) -> None:
    tamper(project)
    done = deja("replay", "cassettes/bad.jsonl", "cassettes/same.jsonl", f"cassettes/{CHANGED}",
                "--json", cwd=project, env={"GITHUB_ACTIONS": "true"})
    assert done.returncode == 2, done.stdout + done.stderr
    document = json.loads(done.stdout)  # stdout holds the JSON alone
    results = document["results"]
    assert [(r["cassette"], r["verdict"], r["exit_status"]) for r in results] == [
        ("cassettes/bad.jsonl", "error", 2), ("cassettes/same.jsonl", "identical", 0),
        (f"cassettes/{CHANGED}", "diverged", 1)]
    assert results[0]["result"] is None and "SignatureError" in results[0]["error"]
    assert results[1]["result"]["steps_served"] == 3
    assert results[2]["result"]["divergence"]["step"] == 1
    summary = document["summary"]
    assert (summary["cassettes"], summary["passed"], summary["diverged"], summary["error"],
            summary["exit_status"]) == (3, 1, 1, 1, 2)
    # with --json the annotations go to stderr, which GitHub reads too
    assert done.stderr.count("\n::error file=") == 2, done.stderr
    assert "Error: SignatureError" in done.stderr


def parse_annotations(text: str) -> list[tuple[str, dict[str, str], str]]:
    """The workflow commands in ``text``, unescaped as GitHub's runner reads them."""
    def unescape(value: str, prop: bool) -> str:
        if prop:
            value = value.replace("%3A", ":").replace("%2C", ",")
        return value.replace("%0D", "\r").replace("%0A", "\n").replace("%25", "%")

    found = []
    for line in text.splitlines():
        match = re.fullmatch(r"::(\w+) ([^:]*)::(.*)", line)
        if match:
            props = dict(p.split("=", 1) for p in match.group(2).split(","))
            found.append((match.group(1), {k: unescape(v, True) for k, v in props.items()},
                          unescape(match.group(3), False)))
    return found


def test_github_annotations_point_at_the_diverging_line(project: Path) -> None:
    tamper(project, "bad:1,x.jsonl")
    done = deja("replay", f"cassettes/{CHANGED}", "cassettes/volatile.jsonl",
                "cassettes/bad:1,x.jsonl", "cassettes/same.jsonl", cwd=project,
                env={"GITHUB_ACTIONS": "true"})
    assert done.returncode == 2, done.stdout + done.stderr
    assert "file=cassettes/changed%2C100%25.jsonl,line=" in done.stdout  # escaped
    [diverged, equivalent, bad] = parse_annotations(done.stdout)
    command, props, message = diverged
    assert command == "error" and props["file"] == f"cassettes/{CHANGED}"
    assert props["title"] == "deja replay diverged (changed_request)"
    line = (project / props["file"]).read_text().splitlines()[int(props["line"]) - 1]
    assert json.loads(line)["seq"] == 1  # the line of the diverging step
    assert message.startswith(f"cassettes/{CHANGED} (run r_")
    assert "diverged at step 1 (changed_request)" in message
    command, props, message = equivalent
    assert (command, props["file"], props["title"]) == (
        "notice", "cassettes/volatile.jsonl", "deja replay equivalent")
    assert json.loads((project / props["file"]).read_text().splitlines()[
        int(props["line"]) - 1])["seq"] == 0  # its first equivalent call
    assert "/metadata/user_id" in message
    command, props, message = bad
    assert (command, props["file"], props["title"]) == (
        "error", "cassettes/bad:1,x.jsonl", "deja replay could not run")
    assert "line" not in props and "SignatureError" in message
    # the same run outside GitHub Actions prints none
    plain = deja("replay", f"cassettes/{CHANGED}", cwd=project)
    assert plain.returncode == 1 and "::" not in plain.stdout + plain.stderr


def test_an_annotation_escapes_what_the_runner_reads(tmp_path: Path) -> None:
    """Data: % CR LF; properties also : and ,."""
    outcome = Outcome("odd: a,b%.jsonl", error="100% bad\r\nsecond line: a, b")
    line = annotation(outcome, cwd=Path.cwd())
    assert line == ("::error file=odd%3A a%2Cb%25.jsonl,title=deja replay could not run"
                    "::100%25 bad%0D%0Asecond line: a, b")
    assert annotation(Outcome("x.jsonl", result={"verdict": "identical"})) is None


def test_junit_per_step_fails_the_diverging_step_and_skips_the_rest(project: Path) -> None:
    tamper(project)
    done = deja("replay", f"cassettes/{CHANGED}", "cassettes/bad.jsonl", "--junit",
                "steps.xml", "--junit-cases", "steps", cwd=project)
    assert done.returncode == 2, done.stdout + done.stderr
    report = validated(project / "steps.xml")
    [suite] = report["testsuite"]
    assert (suite["@tests"], suite["@failures"], suite["@errors"], suite["@skipped"]) == (
        "4", "1", "1", "1")
    passed, failed, skipped, bad = suite["testcase"]
    assert {c["@classname"] for c in (passed, failed, skipped)} == {f"cassettes/{CHANGED}"}
    assert passed["@name"] == "step 0 model claude-sonnet-4-6" and len(passed) == 2
    assert failed["@name"] == "step 1 model claude-sonnet-4-6"
    assert "kind: changed_request (prompt)" in child(failed, "failure")["$"]
    assert child(skipped, "skipped")["@message"] == "not reached: the run diverged at step 1"
    assert (bad["@classname"], bad["@name"]) == ("cassettes/bad.jsonl", "bad.jsonl")
    assert "SignatureError" in child(bad, "error")["@message"]


def test_one_cassette_prints_its_report_as_before_and_writes_junit(project: Path) -> None:
    # the form without -- still runs the command after the cassette
    plain = deja("replay", "cassettes/same.jsonl", "python", "agent.py", cwd=project)
    assert plain.returncode == 0, plain.stdout + plain.stderr
    assert plain.stdout.startswith("done\nreplay of r_") and "identical" in plain.stdout
    assert "total:" not in plain.stdout and "│" not in plain.stdout  # no table
    done = deja("replay", f"cassettes/{CHANGED}", "--junit", "one.xml", cwd=project,
                env={"GITHUB_ACTIONS": "true"})
    assert done.returncode == 1, done.stdout + done.stderr
    report, annotation_line = done.stdout.rstrip("\n").rsplit("\n", 1)
    assert report.startswith("replay of r_") and ": DIVERGED" in report
    assert annotation_line.startswith("::error file=cassettes/changed%2C100%25.jsonl,line=3,")
    [case] = cases(validated(project / "one.xml"))
    assert case["@name"] == CHANGED and "failure" in case
    # a bad one: exit 2 as before, and its JUnit error
    tamper(project)
    bad = deja("replay", "cassettes/bad.jsonl", "--junit", "bad.xml", cwd=project)
    assert bad.returncode == 2 and "Error: SignatureError" in bad.stderr
    [case] = cases(validated(project / "bad.xml"))
    assert "SignatureError" in child(case, "error")["@message"]
