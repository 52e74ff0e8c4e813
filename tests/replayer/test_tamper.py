"""The tamper suite: a real cassette broken in every way, through every command.

One real recording, the 61-turn reconciliation run (``examples/reconciliation.py``
through ``deja record`` against the stub model), is mutated by :mod:`tamper` (edits,
inserts, deletes, reorders, duplicates, splices from a second run signed with the same
key, header edits, cuts at every byte of the last two lines, hostile JSON, re-signing
with a key nobody here has). Every mutant goes through ``verify``, ``replay`` (also with
``--allow-unverified``), ``show`` and ``diff`` against the original (also with
``--allow-unverified``, where the flag can matter), ``fork --at 1 --set result=x``,
``resume`` (of the mutant without its end line), ``ls`` of a directory holding it and the
original (strict and with ``--allow-unverified``) and the DuckDB index (``RunIndex``,
strict and allowing unverified files), in process through ``CliRunner``. A sample of
distinct kinds also goes through the real CLI in subprocesses and through the pytest
plugin.

What each command must make of a mutant (:func:`tamper_campaign.judge` and ``judge_row``):

- **tampered** (``REFUSED``): exit 2 and a named ``SignatureError``, ``CorruptCassette``
  or ``UnsupportedFormat`` naming the first bad line (its seq, or the header), from every
  command, ``--allow-unverified`` or not; ``ls`` and the index list it as one error row.
- **cut inside one of the last two lines** (``TORN``): ``verify``, ``replay`` and
  ``fork`` refuse it with ``TornCassette``; ``show`` exits 0 and says ``torn``; ``diff``
  exits 1 (the end is missing); ``ls`` lists it with status ``torn``; ``resume`` cuts the
  torn line, says so, and continues.
- **cut at a line boundary** (``INCOMPLETE``): whole lines, no end line. ``verify`` and
  ``replay`` refuse it (``CorruptCassette``, no end line); ``show`` says ``incomplete``;
  ``diff`` exits 1; ``ls`` lists it ``incomplete``; ``fork`` and ``resume`` continue it.
  Continuing a cut run is what fork and resume are for, so they are run on a few cut
  files only (every 97th with ``DEJA_TAMPER=full``), with a command given (``-- python -c
  pass``) rather than the recorded agent.
- **re-signed whole by a key nobody here has** (``UNVERIFIED``): refused by every strict
  command (``UnverifiedCassette``, or a named corruption found first); with
  ``--allow-unverified``, ``show``, ``diff``, ``ls`` and the index mark it ``NOT
  VERIFIED`` (or refuse it by name), and ``replay`` still never runs its header's command.

Never, for any mutant: a traceback, a marker file (every header mutation's ``argv``
creates one; the exceptions are the other run's genuine header spliced in, and a signed
header line with a second, shadowed key), a write to the mutant, or a fork cassette
written from a refused parent. The figures are printed at the end of the run
(tests/conftest.py). ``DEJA_TAMPER=full`` (``make stress``) runs every mutation of three
seeds, and five times the real-CLI and plugin sample.
"""

from __future__ import annotations

import json
import random
import shutil
import time
import xml.etree.ElementTree as ET
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import tamper
from click.testing import CliRunner
from tamper import ATTACKER_KEY, OTHER_KNOWN_KEY, Expect, Mutant, Mutations, Source
from tamper_campaign import (
    COMMANDS,
    FULL,
    KEY,
    QUOTA,
    QUOTA_FACTOR,
    ROOT,
    SEEDS,
    TAMPERED,
    Campaign,
    Failure,
    InProcess,
    Recordings,
    Run,
    Sampled,
    Tally,
    clean_env,
    failures_report,
    judge,
    real_cli,
    record_run,
    resume_data,
    selected,
)

from deja.cli import main
from recorder import errors
from recorder.cassette import load
from viewer.index import RunIndex


@pytest.fixture(scope="session")
def recordings(tmp_path_factory: pytest.TempPathFactory) -> Recordings:
    out = tmp_path_factory.mktemp("tamper-recordings")
    with ThreadPoolExecutor(2) as pool:
        recon = pool.submit(record_run, "reconciliation", "reconciliation.py",
                            "reconciliation.stub.json", out)
        spiral = pool.submit(record_run, "retry_spiral", "retry_spiral.py",
                             "retry_spiral.stub.json", out)
        return Recordings(recon.result(), spiral.result())


@pytest.fixture(scope="session")
def campaign(recordings: Recordings, tmp_path_factory: pytest.TempPathFactory) -> Campaign:
    started = time.perf_counter()
    work = tmp_path_factory.mktemp("tamper")
    marker_dir = work / "markers"
    marker_dir.mkdir()
    sample_dir = work / "sample"
    sample_dir.mkdir()
    source = Source.of(recordings.original.read_bytes())
    other = Source.of(recordings.other.read_bytes())
    mutations = Mutations(source, other, marker_dir, SEEDS,
                          foreign_per_path=2 if FULL else 1)
    env = clean_env(work / "home")
    env["RECON_LEDGER"] = str(work / "ledger.sqlite")
    tally = Tally()
    rng = random.Random("tamper-selection")
    pick = random.Random("tamper-sample")
    reservoir: dict[str, list[Mutant]] = {}
    sample: list[Sampled] = []
    futures: list[tuple[Sampled, Future[list[Run]]]] = []
    with pytest.MonkeyPatch.context() as mp, ThreadPoolExecutor(2) as pool:
        for name, value in env.items():
            if name.startswith(("DEJA_", "ANTHROPIC_", "RECON_")):
                mp.setenv(name, value)
        for name in ("DEJA_ALLOW_UNVERIFIED", "ANTHROPIC_API_KEY"):
            mp.delenv(name, raising=False)
        inproc = InProcess(work, source, recordings.original, tally, marker_dir)

        def submit(kind: str) -> None:  # a kind's sample, once it is drawn, to the real CLI
            for m in reservoir.pop(kind, []):
                sampled = Sampled(m, sample_dir / f"s{len(sample):03d}.jsonl",
                                  resume_data(m, source))
                sampled.path.write_bytes(m.data)
                sample.append(sampled)
                futures.append((sampled, pool.submit(real_cli, sampled, work, env,
                                                     recordings.original)))

        seen = Counter[str]()
        for m in mutations:
            tally.generated[m.kind] += 1
            if reservoir and m.kind not in reservoir:
                submit(next(iter(reservoir)))
            if not selected(m, source, rng):
                continue
            tally.mutants[m.kind] += 1
            seen[m.kind] += 1
            quota = QUOTA[m.kind] * QUOTA_FACTOR
            group = reservoir.setdefault(m.kind, [])
            if len(group) < quota:
                group.append(m)
            elif (j := pick.randrange(seen[m.kind])) < quota:
                group[j] = m
            inproc.one(sum(tally.mutants.values()), m)
        for kind in list(reservoir):
            submit(kind)
        inproc.close()
        real = [(s, f.result()) for s, f in futures]
    for _, runs in real:
        for run in runs:
            tally.runs[f"real {run.command}"] += 1
            if run.traceback:
                tally.tracebacks += 1
    for leftover in marker_dir.iterdir():  # a command run from a header, whichever it was
        tally.commands_run += 1
        tally.failures.append(Failure("?", leftover.name, "?", "a marker file was created", ""))
    return Campaign(recordings, source, mutations, tally, sample, real,
                    time.perf_counter() - started)


# ------------------------------------------------------------------------ the tests


def test_the_recordings_are_real_runs(recordings: Recordings) -> None:
    source = Source.of(recordings.original.read_bytes())
    assert 130 <= len(source) <= 160, len(source)
    models = [d for d in source.docs if d.get("kind") == "model"]
    assert len(models) == 61
    assert source.docs[-1]["status"] == "completed"
    other = Source.of(recordings.other.read_bytes())
    assert other.docs[0]["key_id"] == source.docs[0]["key_id"]
    assert other.docs[0]["run"] != source.docs[0]["run"]
    runner = CliRunner()
    for path in (recordings.original, recordings.other):
        result = runner.invoke(main, ["verify", str(path)])
        assert result.exit_code == 0, result.output


def test_the_suite_sees_a_command_run_and_a_whole_replay(
        recordings: Recordings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The suite's detectors work: a header signed with this machine's key is trusted, and
    its command runs; so does an unverified one's with --run-recorded-command; and the
    original replays identical."""
    monkeypatch.setenv("ANTHROPIC_BASE_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("RECON_LEDGER", str(tmp_path / "ledger.sqlite"))
    source = Source.of(recordings.original.read_bytes())
    runner = CliRunner()
    for key, flags in ((KEY.encode(), []),
                       (ATTACKER_KEY, ["--allow-unverified", "--run-recorded-command"])):
        marker = tmp_path / f"ran-{len(flags)}"
        docs = [source.doc(i) for i in range(len(source))]
        docs[0]["argv"] = ["python", "-c", f"open({str(marker)!r}, 'w').close()"]
        path = tmp_path / f"signed-{len(flags)}.jsonl"
        path.write_bytes(tamper.join(tamper.resign(docs, key)))
        runner.invoke(main, ["replay", str(path), *flags])
        assert marker.exists(), f"the marker command did not run with {flags}"
    result = runner.invoke(main, ["replay", str(recordings.original)])
    assert result.exit_code == 0, result.output
    assert "identical" in result.output


def test_a_key_twice_in_a_line_is_refused(recordings: Recordings, tmp_path: Path) -> None:
    """Found by the suite: a second value for a key, before the signed one, rode along
    outside the signature (Python's json keeps the last value, other readers the first)."""
    source = Source.of(recordings.original.read_bytes())
    marker = tmp_path / "ran"
    argv = json.dumps(["python", "-c", f"open({str(marker)!r}, 'w').close()"])
    for index, extra in ((0, f'"argv":{argv},'), (1, '"kind":"effect",'), (2, '"sig":"x",')):
        lines = list(source.raw)
        lines[index] = b"{" + extra.encode() + lines[index][1:]
        path = tmp_path / f"twice-{index}.jsonl"
        path.write_bytes(tamper.join(lines))
        with pytest.raises(errors.CorruptCassette, match="appears twice"):
            load(path)
        result = CliRunner().invoke(main, ["replay", str(path)])
        assert result.exit_code == 2 and "CorruptCassette" in result.stderr
    assert not marker.exists()


@pytest.mark.parametrize("header_sig", ["re-signed", "garbled", "removed"])
def test_a_replaced_header_over_lines_signed_here_is_tampered(
        recordings: Recordings, tmp_path: Path, header_sig: str) -> None:
    """Found by the suite: a header whose key_id and signature were both replaced passed
    as merely unverified (and was shown with --allow-unverified), although every line after
    it is signed with this machine's key."""
    source = Source.of(recordings.original.read_bytes())
    header = {**source.doc(0), "argv": ["python", "-c", "pass"]}
    line = tamper.resign([header], ATTACKER_KEY)[0]
    if header_sig != "re-signed":
        doc = json.loads(line)
        doc.pop("sig")
        if header_sig == "garbled":
            doc["sig"] = tamper.fake_sig(random.Random(0))
        line = tamper.dump(doc)
    path = tmp_path / "replaced.jsonl"
    path.write_bytes(tamper.join([line, *source.raw[1:]]))
    for allow in (False, True):
        with pytest.raises(errors.SignatureError, match="this machine's key"):
            load(path, allow_unverified=allow)
    whole = tmp_path / "forged.jsonl"  # every line re-signed: nothing of ours to recognise
    docs = [source.doc(i) for i in range(len(source))]
    whole.write_bytes(tamper.join(tamper.resign(docs, ATTACKER_KEY)))
    assert not load(whole, allow_unverified=True).verified


def test_a_hostile_header_beside_a_cassette_is_no_traceback(
        recordings: Recordings, tmp_path: Path) -> None:
    """Found by the suite: a first line nested 10,000 deep made `deja resume` of it, and
    `deja show` of any cassette in its directory, end in a RecursionError."""
    shutil.copy(recordings.original, tmp_path / "good.jsonl")
    deep = tmp_path / "deep.jsonl"
    deep.write_bytes(b'{"a":' * 10_000 + b"1" + b"}" * 10_000 + b"\n")
    runner = CliRunner()
    shown = runner.invoke(main, ["show", str(tmp_path / "good.jsonl")])
    assert shown.exit_code == 0, shown.output
    resumed = runner.invoke(main, ["resume", str(deep)])
    assert resumed.exit_code == 2 and "CorruptCassette" in resumed.stderr, resumed.output


def test_odd_values_in_an_allowed_unverified_cassette_break_no_listing(
        recordings: Recordings, tmp_path: Path) -> None:
    """Found by the suite (DEJA_TAMPER=full): values deja never writes, in a cassette that
    verifies or is allowed unverified, ended `deja ls` and the index in a traceback: a null
    response header without a headers_base, token counts and latencies beyond 64 bits, and
    end totals that are not numbers."""
    source = Source.of(recordings.original.read_bytes())
    model = next(i for i, d in enumerate(source.docs) if d.get("kind") == "model")
    cases = {
        "null-header": ((model, "response", "headers", 3), None, "CorruptCassette"),
        "huge-usage": ((model, "response", "body_json", "usage", "input_tokens"), 2**70, None),
        "huge-ms": ((model + 1, "ms"), 2**70, "CorruptCassette"),
        "text-duration": ((len(source) - 1, "totals", "duration_s"), "x", "CorruptCassette"),
    }
    for name, ((index, *path), value, _) in cases.items():
        docs = [source.doc(i) for i in range(len(source))]
        tamper.put(docs[index], tuple(path), value)
        (tmp_path / f"{name}.jsonl").write_bytes(tamper.join(tamper.resign(docs, ATTACKER_KEY)))
    with RunIndex(tmp_path, allow_unverified=True) as index:
        index.refresh()
        rows = {Path(r["path"]).stem: r for r in index.runs()}
    for name, (_, _, error) in cases.items():
        row = rows[name]
        if error:
            assert row["status"] == "error" and row["error"].startswith(error), row
        else:  # a count no upstream sends is no count: the run is listed without it
            assert row["status"] == "completed" and row["verified"] is False, row
        shown = CliRunner().invoke(main, ["show", str(tmp_path / f"{name}.jsonl"),
                                          "--allow-unverified"])
        assert shown.exception is None or isinstance(shown.exception, SystemExit), shown.output


@pytest.mark.parametrize("kind", tamper.KINDS)
def test_every_mutant_is_refused_or_reported(campaign: Campaign, kind: str) -> None:
    t = campaign.tally
    assert t.mutants[kind] > 0, f"no {kind} mutant was run"
    failures = [f for f in t.failures if f.kind == kind]
    assert not failures, failures_report(failures)


def test_no_marker_file_was_created(campaign: Campaign) -> None:
    assert campaign.tally.commands_run == 0, failures_report(
        [f for f in campaign.tally.failures if "run" in f.reason or "marker" in f.reason])


def test_the_real_cli_refuses_the_sample(campaign: Campaign) -> None:
    kinds = {s.mutant.kind for s in campaign.sample}
    assert kinds == set(tamper.KINDS)
    failures = []
    for sampled, runs in campaign.real:
        m = sampled.mutant
        for run in runs:
            failed = judge(m, run)
            if failed:
                failures.append(Failure(m.kind, m.name, f"real {run.command}", failed,
                                        run.excerpt()))
        fork = sampled.path.with_suffix(".fork.jsonl")
        if fork.exists():
            failures.append(Failure(m.kind, m.name, "real fork", "a fork was written", ""))
    assert not failures, failures_report(failures)


def test_the_pytest_plugin_fails_every_sampled_test(
        campaign: Campaign, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEJA_OLD_KEYS", OTHER_KNOWN_KEY)
    body_ran = pytester.path / "body-ran"
    body_ran.mkdir()
    tests = [f"""
        @pytest.mark.deja({str(campaign.recordings.original)!r})
        def test_original():
            assert reconciliation.main() == 0
    """]
    for i, s in enumerate(campaign.sample):
        tests.append(f"""
        @pytest.mark.deja({str(s.path)!r})
        def test_m{i:03d}():
            open({str(body_ran / f"m{i:03d}")!r}, "w").close()
            assert reconciliation.main() == 0
        """)
    pytester.makepyfile(test_plugin_sample=f"""
        import pytest, sys
        sys.path.insert(0, {str(ROOT / "examples")!r})
        import reconciliation

        @pytest.fixture(autouse=True)
        def agent_env(monkeypatch, tmp_path):
            monkeypatch.setenv("ANTHROPIC_BASE_URL", "http://127.0.0.1:9")
            monkeypatch.setenv("RECON_LEDGER", str(tmp_path / "ledger.sqlite"))
    """ + "".join(tests))
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    report = pytester.path / "report.xml"
    pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--junitxml={report}", "-q")
    cases = {c.get("name"): c for c in ET.parse(report).getroot().iter("testcase")}
    assert len(cases) == len(campaign.sample) + 1
    assert not list(cases["test_original"]), "the original cassette must replay and pass"
    failures = []
    outcomes = Counter[str]()
    for i, s in enumerate(campaign.sample):
        case, m = cases[f"test_m{i:03d}"], s.mutant
        problem = [e for e in case if e.tag in ("error", "failure")]
        text = " ".join((e.get("message") or "") + (e.text or "") for e in problem)
        want = {Expect.REFUSED: TAMPERED, Expect.TORN: ("TornCassette",),
                Expect.INCOMPLETE: ("CorruptCassette",),
                Expect.UNVERIFIED: ("UnverifiedCassette", "CorruptCassette",
                                    "UnsupportedFormat")}[m.expect]
        if not problem:
            failures.append(Failure(m.kind, m.name, "pytest plugin", "the test passed", ""))
        elif not any(f"{name}:" in text for name in want):
            failures.append(Failure(m.kind, m.name, "pytest plugin",
                                    f"not failed with {', '.join(want)}", text[:800]))
        else:
            outcomes[problem[0].tag] += 1
        if (body_ran / f"m{i:03d}").exists():
            failures.append(Failure(m.kind, m.name, "pytest plugin", "the test body ran", ""))
    campaign.plugin.update(outcomes, sampled=len(campaign.sample), failures=len(failures))
    assert not failures, failures_report(failures)


def _n(value: int) -> str:
    return f"{value:,}"


def test_figures(campaign: Campaign) -> None:
    """The campaign's figures, printed at the end of the run (see tests/conftest.py)."""
    t, mutations = campaign.tally, campaign.mutations
    total = sum(t.mutants.values())
    good = total - len(t.bad)
    share = "100%" if good == total else f"{100 * good / total:.2f}%"
    in_process = sum(v for k, v in t.runs.items() if not k.startswith("real "))
    real = sum(v for k, v in t.runs.items() if k.startswith("real "))
    per_kind = ", ".join(f"{k} {_n(t.mutants[k])}/{_n(t.generated[k])}" for k in tamper.KINDS)
    plugin = campaign.plugin
    plugin_line = (f"pytest plugin: {plugin['sampled']} mutants, "
                   f"{plugin.get('error', 0) + plugin.get('failure', 0)} tests stopped with the "
                   f"named error ({plugin.get('error', 0)} in setup), {plugin['failures']} "
                   "did not" if plugin else "pytest plugin: not run")
    tamper.SUMMARY[:] = [
        f"tamper: {_n(total)} mutations x {len(COMMANDS)} commands ({_n(in_process)} runs): "
        f"{share} refused or reported torn/incomplete, {t.tracebacks} tracebacks, "
        f"{t.commands_run} commands run, {t.accepted} accepted",
        "tamper: verify refused them with "
        + ", ".join(f"{k} {_n(v)}" for k, v in t.refused_as.most_common())
        + f"; show, diff and ls reported {_n(t.outcomes['torn'])} torn and "
        f"{_n(t.outcomes['incomplete'])} incomplete; {t.continuations} cut files continued "
        "by fork/resume",
        f"tamper: run/generated per kind: {per_kind}; skipped {mutations.unchanged} "
        f"unchanged and {mutations.repeated} repeated files",
        f"tamper: real CLI: {len(campaign.real)} mutants, {_n(real)} subprocess runs; "
        + plugin_line,
        f"tamper: {campaign.seconds:.1f}s" + (", every mutation of three seeds" if FULL else
                                             "; DEJA_TAMPER=full (make stress) runs every "
                                             "mutation of three seeds"),
    ]
    assert good == total and t.tracebacks == 0 and t.commands_run == 0, failures_report(t.failures)
