"""The tamper campaign's machinery: the two real recordings, one command run on a mutant and
its verdict (:func:`judge`, :func:`judge_row`), the tally, and the in-process and real-CLI
runners. The fixtures that run the campaign, and its tests, are in test_tamper.py.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from click.testing import CliRunner
from tamper import OTHER_KNOWN_KEY, Expect, Mutant, Mutations, Source

from deja.cli import main
from recorder import errors
from recorder.testing.server import StubServer
from viewer.index import RunIndex, index_path

ROOT = Path(__file__).resolve().parents[2]
KEY = "test-key-0123456789abcdef"  # conftest's DEJA_KEY
FULL = os.environ.get("DEJA_TAMPER", "").strip().lower() == "full"
SEEDS = (0, 1, 2) if FULL else (0,)
# Without DEJA_TAMPER=full, the share of each kind that is run (seeded; cuts: see below).
SHARE = {"edit": 0.05, "insert": 0.07, "delete": 0.1, "reorder": 0.06, "duplicate": 0.08,
         "splice": 1.0, "header": 1.0, "cut": 0.0, "hostile": 0.25, "foreign": 0.08}
# Mutants of each kind that also go through the real CLI and the pytest plugin.
QUOTA = {"edit": 4, "insert": 2, "delete": 2, "reorder": 2, "duplicate": 2, "splice": 3,
         "header": 6, "cut": 3, "hostile": 4, "foreign": 2}
QUOTA_FACTOR = 5 if FULL else 1
CHUNK = 100  # mutants per ls directory and index refresh
HARMLESS = ["--", "python", "-c", "pass"]  # the command a legitimate continuation runs
TAMPERED = ("SignatureError", "CorruptCassette", "UnsupportedFormat")


def _error_names(cls: type) -> set[str]:
    return {cls.__name__}.union(*(_error_names(sub) for sub in cls.__subclasses__()))


NAMED = frozenset(_error_names(errors.DejaError))  # an error deja names when it refuses
COMMANDS = ("verify", "replay", "replay --allow-unverified", "show",
            "show --allow-unverified", "diff", "diff --allow-unverified", "fork", "resume",
            "ls", "ls --allow-unverified", "index", "index (allowing unverified)")


# ------------------------------------------------------------------------ recording


def record_run(name: str, agent: str, script: str, out: Path) -> Path:
    server = StubServer(json.loads((ROOT / "examples" / script).read_text())).start()
    try:
        env = {**clean_env(out / "home"), "ANTHROPIC_BASE_URL": server.url,
               "RECON_LEDGER": str(out / f"{name}.ledger.sqlite")}
        path = out / f"{name}.jsonl"
        done = subprocess.run([sys.executable, "-m", "deja", "record", "-o", str(path), "--",
                               "python", f"examples/{agent}"], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=180)
        assert path.exists(), done.stderr
        return path
    finally:
        server.stop()


def clean_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DEJA_", "ANTHROPIC_", "RECON_"))}
    env.update(DEJA_HOME=str(home), DEJA_KEY=KEY, DEJA_OLD_KEYS=OTHER_KNOWN_KEY,
               ANTHROPIC_BASE_URL="http://127.0.0.1:9")  # nothing listens there
    return env


@dataclass(frozen=True)
class Recordings:
    original: Path  # the reconciliation run
    other: Path  # a retry-spiral run, signed with the same key


# ------------------------------------------------------------------------ one command


@dataclass(frozen=True)
class Run:
    command: str
    code: int | None
    out: str
    err: str
    traceback: str | None = None

    @property
    def named(self) -> str | None:
        """The deja error the command was refused with (click prints ``Error: Name: ...``)."""
        found = re.search(r"Error: (\w+): ", self.err)
        return found.group(1) if found and found.group(1) in NAMED else None

    def excerpt(self) -> str:
        text = self.traceback or f"exit {self.code}: {self.err.strip() or self.out.strip()}"
        return text[-1200:]


def invoke(runner: CliRunner, command: str, args: list[str]) -> Run:
    result = runner.invoke(main, args, catch_exceptions=True)
    exc = result.exception
    tb = None
    if exc is not None and not isinstance(exc, SystemExit):
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return Run(command, result.exit_code, result.stdout, result.stderr, tb)


def run_real(command: str, args: list[str], env: dict[str, str], cwd: Path) -> Run:
    done = subprocess.run([sys.executable, "-m", "deja", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=180)
    tb = done.stderr if "Traceback (most recent call last)" in done.stderr else None
    return Run(command, done.returncode, done.stdout, done.stderr, tb)


def names_line(text: str, line: int | None) -> bool:
    """The refusal points at the first bad line: its seq, or the header."""
    if line is None:
        return True
    if line == 0:
        return any(w in text for w in ("header", "line 1", "format"))
    return re.search(rf"\bseq {line - 1}\b", text) is not None


def judge(m: Mutant, run: Run) -> str | None:
    """Why ``run`` is not an acceptable outcome for ``m`` (None: it is)."""
    if run.traceback:
        return "traceback"
    cmd, code, name, text = run.command, run.code, run.named, run.out + run.err
    lenient = "--allow-unverified" in cmd

    def refused(*names: str) -> str | None:
        if code != 2 or name not in names:
            return f"expected exit 2 naming one of {', '.join(names)}"
        return None

    if m.expect is Expect.REFUSED:
        return refused(*TAMPERED) or (None if names_line(run.err, m.line) else
                                      f"the refusal does not name line {m.line} "
                                      f"(seq {m.line - 1 if m.line else 'header'})")
    if m.expect is Expect.UNVERIFIED:
        if not lenient:
            return refused("UnverifiedCassette", "CorruptCassette", "UnsupportedFormat")
        if code == 2 and name in ("CorruptCassette", "UnsupportedFormat"):
            return None
        if cmd.startswith("replay"):
            return (None if code == 2 and "NOT VERIFIED" in run.err
                    and "does not run the command" in run.err
                    else "replay of an unverified cassette must not run its command")
        ok = (code == 0) if cmd.startswith("show") else code in (0, 1)
        return None if ok and "NOT VERIFIED" in text else "not marked NOT VERIFIED"
    torn = m.expect is Expect.TORN
    if cmd in ("verify", "replay", "replay --allow-unverified") or (cmd == "fork" and torn):
        failed = refused("TornCassette" if torn else "CorruptCassette")
        if failed or torn or "no end line" in run.err:
            return failed
        return "an incomplete cassette must be refused for its missing end line"
    if cmd.startswith("show"):
        word = "torn" if torn else "incomplete"
        return None if code == 0 and f"status {word}" in run.out else f"show must say {word}"
    if cmd.startswith("diff"):
        return None if code == 1 else "a cut run must differ from the whole one"
    if cmd in ("fork", "resume"):  # continuing a cut run is what fork and resume are for
        if code != 0:
            return "a legitimate continuation failed"
        return None if not (torn and "torn" not in run.err) else "resume must say torn"
    return f"no rule for {cmd}"


def judge_row(m: Mutant, row: dict[str, Any] | None, lenient: bool) -> str | None:
    """Why ``row`` (of ``ls`` or the index) is not acceptable for ``m``."""
    if row is None:
        return "no row (or more than one) for the mutant"
    status, error = row.get("status"), row.get("error") or ""
    named = error.split(":", 1)[0]
    if m.expect is Expect.REFUSED or (m.expect is Expect.UNVERIFIED and not lenient):
        names = TAMPERED if m.expect is Expect.REFUSED else (
            "UnverifiedCassette", "CorruptCassette", "UnsupportedFormat")
        if status != "error" or named not in names:
            return f"expected an error row naming one of {', '.join(names)}"
        return None if m.expect is not Expect.REFUSED or names_line(error, m.line) else \
            "the error row does not name the first bad line"
    if m.expect is Expect.UNVERIFIED:
        if status == "error":
            return None if named in ("CorruptCassette", "UnsupportedFormat") else \
                "an unverified file allowed is listed as an error"
        return None if row.get("verified") is False else "not marked unverified"
    want = "torn" if m.expect is Expect.TORN else "incomplete"
    if status != want:
        return f"status {status!r}, expected {want!r}"
    if m.expect is Expect.TORN and "torn" not in error:
        return "the row does not say torn"
    return None


# ------------------------------------------------------------------------ the campaign


@dataclass
class Failure:
    kind: str
    mutant: str
    command: str
    reason: str
    excerpt: str

    def __str__(self) -> str:
        return f"[{self.kind}] {self.mutant} / {self.command}: {self.reason}\n{self.excerpt}"


@dataclass
class Tally:
    generated: Counter[str] = field(default_factory=Counter)
    mutants: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[str] = field(default_factory=Counter)  # refused/torn/incomplete
    refused_as: Counter[str] = field(default_factory=Counter)  # the error verify named
    runs: Counter[str] = field(default_factory=Counter)  # per command
    tracebacks: int = 0
    commands_run: int = 0
    accepted: int = 0  # exit 0 or 1 where a refusal was due
    continuations: int = 0
    failures: list[Failure] = field(default_factory=list)
    bad: set[int] = field(default_factory=set)  # serial numbers of mutants with a failure

    def fail(self, serial: int, m: Mutant, command: str, reason: str, excerpt: str = ""
             ) -> None:
        self.failures.append(Failure(m.kind, m.name, command, reason, excerpt))
        self.bad.add(serial)

    def count(self, serial: int, m: Mutant, run: Run) -> None:
        self.runs[run.command] += 1
        failed = judge(m, run)
        if failed is None:
            return
        self.tracebacks += run.traceback is not None
        self.accepted += (run.code in (0, 1) and m.expect in (Expect.REFUSED, Expect.UNVERIFIED)
                          and "--allow-unverified" not in run.command)
        self.fail(serial, m, run.command, failed, run.excerpt())


@dataclass
class Sampled:
    mutant: Mutant
    path: Path
    resume_data: bytes | None


@dataclass
class Campaign:
    recordings: Recordings
    source: Source
    mutations: Mutations
    tally: Tally
    sample: list[Sampled]
    real: list[tuple[Sampled, Run]]
    seconds: float
    plugin: dict[str, int] = field(default_factory=dict)


def _last_line(source: Source) -> int:
    """Where the last line (the end line) starts."""
    return len(source.data) - len(source.raw[-1]) - 1


def selected(m: Mutant, source: Source, rng: random.Random) -> bool:
    if FULL or m.expect is Expect.INCOMPLETE:
        return True
    if m.kind == "cut":  # besides the line boundaries, the first and last byte of each line
        last = _last_line(source)
        first = last - len(source.raw[-2]) - 1
        return len(m.data) in (first + 1, last - 1, last + 1, len(source.data) - 1)
    return rng.random() < SHARE[m.kind]


def _continues(m: Mutant, source: Source) -> bool:
    """Whether fork and resume are run on a cut file (with HARMLESS: they continue it).
    Without DEJA_TAMPER=full: the file without its end line, and the one without its
    last newline (resume only)."""
    if m.expect is Expect.INCOMPLETE:
        return FULL or len(m.data) == _last_line(source)
    return m.expect is Expect.TORN and (len(m.data) == len(source.data) - 1
                                        or (FULL and len(m.data) % 97 == 0))


def resume_data(m: Mutant, source: Source) -> bytes | None:
    """The mutant as a crashed run (its end line cut), for ``resume``; None when that
    leaves an untouched prefix of the original (a legitimate crashed run, not a mutant)."""
    if m.expect in (Expect.TORN, Expect.INCOMPLETE):
        return m.data
    end = source.raw[-1] + b"\n"
    data = m.data[:-len(end)] if m.data.endswith(end) else m.data
    if source.data.startswith(data[:data.rfind(b"\n") + 1]):  # whole lines untouched
        return None
    return data


class InProcess:
    """Runs every command on mutants, in this process."""

    def __init__(self, work: Path, campaign_source: Source, original: Path, tally: Tally,
                 marker_dir: Path) -> None:
        self.runner = CliRunner()
        self.work = work
        self.source = campaign_source
        self.original = original
        self.tally = tally
        self.marker_dir = marker_dir
        self.target = work / "mutant" / "cassette.jsonl"
        self.resume_target = work / "resume" / "cassette.jsonl"
        self.fork_out = work / "fork" / "new.jsonl"
        for p in (self.target, self.resume_target, self.fork_out):
            p.parent.mkdir(parents=True)
        self.index_dirs = {lenient: work / f"index-{lenient}" for lenient in (False, True)}
        for d in self.index_dirs.values():
            d.mkdir()
            shutil.copy(original, d / "original.jsonl")
        self.indexes = {lenient: RunIndex(d, allow_unverified=lenient)
                        for lenient, d in self.index_dirs.items()}
        self.chunk: list[tuple[int, Mutant]] = []
        self.previous: list[str] = []
        self.primed = {False: False, True: False}  # the index holds the original

    def close(self) -> None:
        if self.chunk:
            self.flush()
        for index in self.indexes.values():
            index.close()

    def _check_marker(self, serial: int, m: Mutant, command: str) -> None:
        if m.marker and (self.marker_dir / m.marker).exists():
            (self.marker_dir / m.marker).unlink()
            self.tally.commands_run += 1
            self.tally.fail(serial, m, command, "the command its header names was run")

    def one(self, serial: int, m: Mutant) -> None:
        t = self.tally
        self.target.write_bytes(m.data)
        path, orig = str(self.target), str(self.original)
        cont = _continues(m, self.source)
        plan: list[tuple[str, list[str]]] = [
            ("verify", ["verify", path]),
            ("replay", ["replay", path]),
            ("replay --allow-unverified", ["replay", path, "--allow-unverified"]),
            ("show", ["show", path]),
            ("diff", ["diff", path, orig]),
        ]
        if m.expect in (Expect.REFUSED, Expect.UNVERIFIED):  # the flag is moot for a cut file
            plan += [("show --allow-unverified", ["show", path, "--allow-unverified"]),
                     ("diff --allow-unverified", ["diff", path, orig, "--allow-unverified"])]
        if m.expect is not Expect.INCOMPLETE or cont:
            plan.append(("fork", ["fork", path, "--at", "1", "--set", "result=x", "-o",
                                  str(self.fork_out), *(HARMLESS if cont else [])]))
        runs: list[Run] = []
        for command, args in plan:
            run = invoke(self.runner, command, args)
            runs.append(run)
            t.count(serial, m, run)
            self._check_marker(serial, m, command)
        if self.target.read_bytes() != m.data:
            t.fail(serial, m, "all", "a command wrote to the mutant")
        if self.fork_out.exists():
            if not cont:
                t.fail(serial, m, "fork", "a fork cassette was written from a refused parent")
            self.fork_out.unlink()
        elif cont and m.expect is Expect.INCOMPLETE:
            t.fail(serial, m, "fork", "a fork of a cut (but signed) run wrote no cassette")
        data = resume_data(m, self.source)
        if data is not None and (m.expect not in (Expect.TORN, Expect.INCOMPLETE) or cont):
            self.resume_target.write_bytes(data)
            run = invoke(self.runner, "resume", ["resume", str(self.resume_target),
                                                 *(HARMLESS if cont else [])])
            runs.append(run)
            t.count(serial, m, run)
            self._check_marker(serial, m, "resume")
            if not cont and self.resume_target.read_bytes() != data:
                t.fail(serial, m, "resume", "a refused resume wrote to the cassette")
        t.continuations += cont
        verify = runs[0]
        if serial not in t.bad:
            t.outcomes[m.expect.value] += 1
            if verify.named:
                t.refused_as[verify.named] += 1
        self.chunk.append((serial, m))
        if len(self.chunk) >= CHUNK:
            self.flush()

    def flush(self) -> None:
        """``ls`` and the index over the chunk's mutants beside the original."""
        chunk, self.chunk = self.chunk, []
        names = {f"m{serial:05d}.jsonl": (serial, m) for serial, m in chunk}
        ls_dir = self.work / "ls"
        ls_dir.mkdir()
        shutil.copy(self.original, ls_dir / "original.jsonl")
        for name, (_, m) in names.items():
            (ls_dir / name).write_bytes(m.data)
        for lenient in (False, True):
            command = "ls --allow-unverified" if lenient else "ls"
            rows, run, _ = self._list(command, ls_dir, lenient)
            self._rows(command, names, rows, run, lenient)
        shutil.rmtree(ls_dir)
        for lenient in (False, True):
            command = "index (allowing unverified)" if lenient else "index"
            directory = self.index_dirs[lenient]
            for name in self.previous:
                (directory / name).unlink()
            for name, (_, m) in names.items():
                (directory / name).write_bytes(m.data)
            rows, run, stats = self._list(command, directory, lenient, self.indexes[lenient])
            if rows is None:  # start the index afresh for the next chunk
                self.indexes[lenient].close()
                db = index_path(directory)
                for leftover in db.parent.glob(db.name + "*"):
                    leftover.unlink()
                self.indexes[lenient] = RunIndex(directory, allow_unverified=lenient)
                self.primed[lenient] = False
            elif stats is not None:
                first = not self.primed[lenient]  # the original is indexed once, then kept
                want = {"indexed": len(names) + first, "unchanged": int(not first),
                        "removed": 0 if first else len(self.previous)}
                self.primed[lenient] = True
                if any(stats[k] != v for k, v in want.items()):
                    for serial, m in names.values():
                        self.tally.fail(serial, m, command, f"refresh did {stats}, not {want}")
            self._rows(command, names, rows, run, lenient)
        self.previous = list(names)

    def _list(self, command: str, directory: Path, lenient: bool,
              index: RunIndex | None = None
              ) -> tuple[list[dict[str, Any]] | None, Run, dict[str, int] | None]:
        """The rows ``ls`` (or ``index``, a RunIndex) gives for ``directory``; None when it
        failed, with the run that says how."""
        if command.startswith("ls"):
            run = invoke(self.runner, command, ["ls", str(directory), "--json",
                                                *(["--allow-unverified"] * lenient)])
            ok = run.code == 0 and not run.traceback
            return (json.loads(run.out) if ok else None), run, None
        own = index or RunIndex(directory, allow_unverified=lenient)
        try:
            stats = own.refresh()
            return own.runs(), Run(command, 0, "", ""), stats
        except Exception:  # noqa: BLE001 - a traceback is the suite's finding, not its end
            return None, Run(command, None, "", "", traceback.format_exc()), None
        finally:
            if index is None:
                own.close()

    def _rows(self, command: str, names: dict[str, tuple[int, Mutant]],
              rows: list[dict[str, Any]] | None, run: Run, lenient: bool,
              isolated: bool | None = None) -> None:
        t = self.tally
        by_name: dict[str, list[dict[str, Any]]] = {}
        for row in rows or []:
            by_name.setdefault(Path(row["path"]).name, []).append(row)
        if isolated is None:
            t.runs[command] += len(names)
        if rows is None:
            if isolated is None and len(names) > 1:  # find which mutants broke the listing
                for name, case in names.items():
                    alone = self.work / "alone"
                    alone.mkdir()
                    shutil.copy(self.original, alone / "original.jsonl")
                    (alone / name).write_bytes(case[1].data)
                    rows, run, _ = self._list(command, alone, lenient)
                    self._rows(command, {name: case}, rows, run, lenient, isolated=True)
                    shutil.rmtree(alone)
                return
            t.tracebacks += run.traceback is not None
            for serial, m in names.values():
                t.fail(serial, m, command, "the listing failed", run.excerpt())
            return
        original = by_name.get("original.jsonl", [])
        if len(original) != 1 or original[0]["status"] != "completed" \
                or not original[0]["verified"] or original[0]["error"]:
            for serial, m in names.values():
                t.fail(serial, m, command, f"the original is not listed fine: {original}")
        for name, (serial, m) in names.items():
            found = by_name.get(name, [])
            failed = judge_row(m, found[0] if len(found) == 1 else None, lenient)
            if failed:
                t.fail(serial, m, command, failed, json.dumps(found, default=str)[:800])


def real_cli(sampled: Sampled, work: Path, env: dict[str, str], original: Path
              ) -> list[Run]:
    m, path = sampled.mutant, str(sampled.path)
    plan = [("verify", ["verify", path]), ("replay", ["replay", path])]
    if m.expect is Expect.UNVERIFIED:
        plan.append(("replay --allow-unverified", ["replay", path, "--allow-unverified"]))
    if m.expect in (Expect.TORN, Expect.INCOMPLETE):
        plan += [("show", ["show", path]), ("diff", ["diff", path, str(original)])]
    else:
        plan.append(("fork", ["fork", path, "--at", "1", "--set", "result=x", "-o",
                              str(sampled.path.with_suffix(".fork.jsonl"))]))
        if sampled.resume_data is not None:
            copy = sampled.path.with_suffix(".resume.jsonl")
            copy.write_bytes(sampled.resume_data)
            plan.append(("resume", ["resume", str(copy)]))
    return [run_real(command, args, env, work) for command, args in plan]


def failures_report(failures: list[Failure], limit: int = 15) -> str:
    shown = "\n\n".join(str(f) for f in failures[:limit])
    more = ""
    if len(failures) > limit:
        every = Path(tempfile.gettempdir()) / "deja-tamper-failures.txt"
        every.write_text("\n\n".join(str(f) for f in failures))
        more = f"\n\n... and {len(failures) - limit} more (all of them: {every})"
    return f"{len(failures)} failures:\n\n{shown}{more}"
