"""The pytest plugin's record modes: a test's settings, its mode, and the recording it starts.

The modes (vcrpy's names, adapted to cassettes that are signed, append-only logs of one
run) and the order a test's mode is chosen in are tabled in :mod:`replayer.pytest_plugin`.
Here they become a :class:`Plan` (replay, or which recording) and a :class:`Recording`.

A recording that may replace a cassette is written beside it (``.<name>.<pid>.new.jsonl``)
and renamed over it in one step (``os.replace``) once the test passed: the cassette is
never half-written, and a failing test leaves it as it was.

A dry run (``--deja-dry-run``, with ``all`` or ``rewrite``) records each test live into a
temporary file that is never kept, and compares it with the cassette
(:mod:`replayer.drift`): has the provider drifted? The cassette is not written.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from recorder.capture.exchange import Redaction
from recorder.cassette import CassetteWriter, load
from recorder.cassette.keys import load_keyring
from recorder.cassette.schema import utc_stamp
from recorder.launch import new_run_id, portable_launch
from recorder.record import RecordSession

if TYPE_CHECKING:
    from replayer.drift import DriftReport
    from replayer.policy import ReplayPolicy
    from replayer.replay import ReplaySession

MODES = ("none", "once", "new_episodes", "all", "rewrite")
#: What ``deja_config`` may set: the defaults of the marker's keyword arguments.
CONFIG_KEYS = ("record_mode", "allow_unverified", "ignore", "normalise", "allowed_hosts")
MARKER_KEYS = ("cassette", "record", *CONFIG_KEYS)
#: The older flags, each one mode.
ALIASES = {"deja_record": ("--deja-record", "once"), "deja_rerecord": ("--deja-rerecord", "all")}
#: The modes a dry run goes with: those that record every cassette anew.
DRY_RUN_MODES = ("all", "rewrite")


@dataclasses.dataclass(frozen=True)
class Settings:
    """One marked test's settings: the marker's arguments over ``deja_config``'s."""

    cassette: Path
    shown: str = ""  # the cassette as the marker names it, for messages
    record: bool = True  # False: no mode ever records it (an incident)
    record_mode: str | None = None
    mode_from: str = ""  # where record_mode came from, for messages
    allow_unverified: bool = False
    ignore: tuple[str, ...] = ()
    normalise: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] = ()


def settings_of(nodeid: str, marker: pytest.Mark, config: Any, root: Path) -> Settings:
    """The settings of the test ``nodeid`` from its marker and its ``deja_config``."""
    if not isinstance(config, Mapping):
        raise pytest.UsageError(f"{nodeid}: the deja_config fixture returns a dict of the "
                                f"marker's defaults, not {type(config).__name__}")
    _known(nodeid, "the deja_config fixture", config, CONFIG_KEYS)
    _known(nodeid, "@pytest.mark.deja", marker.kwargs, MARKER_KEYS)
    if not marker.args and "cassette" not in marker.kwargs:
        raise pytest.UsageError(f"{nodeid}: @pytest.mark.deja needs a cassette path, e.g. "
                                "@pytest.mark.deja('cassettes/run.jsonl')")
    path = Path(marker.kwargs.get("cassette") or marker.args[0])
    given = {**config, **marker.kwargs}  # the marker's own arguments win
    record = given.get("record", True)
    if not isinstance(record, bool):
        raise pytest.UsageError(f"{nodeid}: @pytest.mark.deja(record=...) is True or False, "
                                f"not {record!r}")
    mode_from = "@pytest.mark.deja" if "record_mode" in marker.kwargs else "deja_config"
    mode = given.get("record_mode")
    return Settings(
        cassette=path if path.is_absolute() else root / path, shown=str(path), record=record,
        record_mode=None if mode is None else checked_mode(mode, f"{nodeid}: {mode_from}"),
        mode_from=mode_from, allow_unverified=bool(given.get("allow_unverified")),
        ignore=_strings(nodeid, given, "ignore"), normalise=_strings(nodeid, given, "normalise"),
        allowed_hosts=_strings(nodeid, given, "allowed_hosts"))


def _known(nodeid: str, where: str, given: Mapping[str, Any], keys: Sequence[str]) -> None:
    unknown = sorted(str(k) for k in given if k not in keys)
    if unknown:
        raise pytest.UsageError(f"{nodeid}: {where} does not take {', '.join(unknown)}; it "
                                f"takes {', '.join(keys)}")


def _strings(nodeid: str, given: Mapping[str, Any], key: str) -> tuple[str, ...]:
    value = given.get(key, ())
    if isinstance(value, str) or not isinstance(value, list | tuple) \
            or not all(isinstance(v, str) for v in value):
        raise pytest.UsageError(f"{nodeid}: {key}= takes a list of strings, not {value!r}")
    return tuple(value)


def checked_mode(mode: Any, where: str) -> str:
    """``mode`` if it names a record mode; else a usage error naming them."""
    if mode not in MODES:
        raise pytest.UsageError(f"{where}: record mode {mode!r} is not one of "
                                f"{', '.join(MODES)}")
    return str(mode)


# -- which mode a test runs in


def on_ci(environ: Mapping[str, str]) -> bool:
    """Whether ``CI`` says this runs on CI (set, and not empty, ``false`` or ``0``)."""
    return environ.get("CI", "").strip().lower() not in ("", "false", "0")


def run_mode(config: pytest.Config) -> tuple[str, str] | None:
    """The mode this run was given, and by what: ``--deja-record-mode`` or one of its
    aliases, else ``DEJA_RECORD_MODE``; None when neither says."""
    given = {}
    flag = config.getoption("deja_record_mode")
    if flag:
        given["--deja-record-mode"] = flag
    for dest, (name, mode) in ALIASES.items():
        if config.getoption(dest):
            given[name] = mode
    if len(set(given.values())) > 1:
        said = ", ".join(f"{name} ({mode})" for name, mode in given.items())
        raise pytest.UsageError(f"deja: {said} ask for different record modes; give one")
    if given:
        name, mode = next(iter(given.items()))
        return mode, name
    env = os.environ.get("DEJA_RECORD_MODE", "").strip()
    if env:
        return checked_mode(env, "DEJA_RECORD_MODE"), "DEJA_RECORD_MODE"
    return None


def dry_run(config: pytest.Config) -> bool:
    """Whether this is a dry run (``--deja-dry-run``); a usage error unless the run's mode
    (the flag, or ``DEJA_RECORD_MODE``) records anew: ``all`` or ``rewrite``."""
    if not config.getoption("deja_dry_run", False):
        return False
    given = run_mode(config)
    if given is None or given[0] not in DRY_RUN_MODES:
        said = f"{given[1]} asks for {given[0]}" if given else "no record mode was given"
        raise pytest.UsageError(
            "deja: --deja-dry-run runs the marked tests live into temporary files and "
            "compares each with its cassette, which it never writes: it goes with "
            f"--deja-record-mode=all or rewrite (or --deja-rerecord); {said}")
    return True


def mode_of(config: pytest.Config, settings: Settings) -> tuple[str, str]:
    """A test's mode and why, for messages: the run's (the flag, then
    ``DEJA_RECORD_MODE``), else ``none`` on CI, else the test's ``record_mode`` (its
    marker's, then its ``deja_config``'s), else ``once``."""
    given = run_mode(config)
    if given is not None:
        mode, name = given
        return mode, f"from {name}" if name.isupper() else f"given by {name}"
    if on_ci(os.environ):
        return "none", "the default on CI, where CI is set"
    if settings.record_mode is not None:
        return settings.record_mode, f"from {settings.mode_from}"
    return "once", "the default"


class Plan(enum.Enum):
    """What the test does with its cassette."""

    REPLAY = "replay"
    RECORD = "record"  # a new cassette, recorded at its path
    ANEW = "anew"  # recorded beside the cassette; replaces it if the test passes (all)
    REWRITE = "rewrite"  # the old file deleted, then recorded at its path
    GROW = "grow"  # replayed, then live from the first call it does not hold
    DRY = "dry"  # recorded into a temporary file, compared with the cassette, not kept


def plan_for(mode: str, exists: bool, recordable: bool, dry: bool = False) -> Plan:
    """What a test in ``mode`` does with a cassette that ``exists`` or not (``dry``: in a
    dry run)."""
    if not recordable or mode == "none" or (exists and mode == "once"):
        return Plan.REPLAY
    if dry:
        return Plan.DRY
    if not exists:
        return Plan.RECORD
    return {"new_episodes": Plan.GROW, "all": Plan.ANEW, "rewrite": Plan.REWRITE}[mode]


# -- recordings


def beside(cassette: Path) -> Path:
    """The file a recording that may replace ``cassette`` is written to."""
    return cassette.with_name(f".{cassette.name}.{os.getpid()}.new.jsonl")


class Recording:
    """A test's recording, and what becomes of its file when the test ends.

    ``temp``: written beside ``target`` and renamed over it if the test passes (and, for
    a grown cassette, if the run did not ask for exactly what the cassette holds);
    otherwise deleted, and the cassette stays as it was.
    """

    def __init__(self, session: RecordSession, target: Path, plan: Plan,
                 temp: Path | None = None, source: ReplaySession | None = None,
                 allow_unverified: bool = False) -> None:
        self.session, self.target, self.plan = session, target, plan
        self.temp, self.source = temp, source
        self.allow_unverified = allow_unverified
        self.drift: DriftReport | None = None  # a dry run's comparison, once finished

    def _changed(self) -> bool:
        """Whether the run differs from the cassette: it left the log, or left some of
        it unasked."""
        return self.source is None or self.source.missed or self.source.index.remaining > 0

    def finish(self, error: BaseException | None, *, ran: bool = True) -> str | None:
        """End the recording with the test's ``error`` (``ran``: the test's call ran to
        its end); what happened to the cassette, for the session's summary (None: it
        was left as it was, holding exactly what the test asked for)."""
        if self.plan is Plan.DRY:
            return self._compared(error)
        try:
            self.session.close(error=error)
        finally:
            keep = ran and error is None and self._changed()
            if self.temp is not None:
                if keep:
                    os.replace(self.temp, self.target)
                else:
                    self.temp.unlink(missing_ok=True)
        return self._note(keep, error is None and ran)

    def _compared(self, error: BaseException | None) -> str:
        """End a dry run: compare its live recording with the cassette (:attr:`drift`),
        then remove it. What was found, in a few words."""
        from recorder.errors import DejaError
        from replayer.drift import drift

        assert self.temp is not None
        try:
            self.session.close(error=error)
            if not self.target.exists():
                return "no cassette to compare with (the live run was not kept)"
            self.drift = dataclasses.replace(
                drift(self.target, self.temp,
                      allow_unverified=True if self.allow_unverified else None),
                live_kept=False)
            return self.drift.summary()
        except DejaError as exc:
            return f"not compared: {type(exc).__name__}: {exc}"
        finally:
            shutil.rmtree(self.temp.parent, ignore_errors=True)

    def _note(self, kept: bool, passed: bool) -> str | None:
        if self.plan is Plan.RECORD:
            return "recorded"
        if self.plan is Plan.REWRITE:
            return "deleted, then recorded anew"
        if not passed:
            return "kept as it was (the test failed; the new recording was discarded)"
        if self.source is None:
            return "recorded anew"
        if not kept:
            return None  # the run asked for exactly what the cassette holds
        used, total = len(self.source.index.used), self.source.index.total
        how = "then new calls recorded live" if self.source.missed else \
            "the rest no longer asked for"
        return f"grew: {used} of its {total} steps replayed, {how}"


def start_recording(plan: Plan, cassette: Path, argv: list[str], policy: ReplayPolicy,
                    allow_unverified: bool = False) -> Recording:
    """Start the recording ``plan`` says for ``cassette`` (``argv``: the test's command;
    ``allow_unverified``: a dry run compares with a cassette this machine cannot verify)."""
    if plan is Plan.DRY:  # nothing is written where the cassette is
        temp = Path(tempfile.mkdtemp(prefix="deja-dry-run-")) / cassette.name
        where = portable_launch(argv, Path.cwd(), cassette)["cassette"]
        try:
            session = RecordSession(temp, argv=argv, overwrite=True,
                                    header={"cassette": where}).start()
        except BaseException:
            shutil.rmtree(temp.parent, ignore_errors=True)
            raise
        return Recording(session, cassette, plan, temp=temp, allow_unverified=allow_unverified)
    cassette.parent.mkdir(parents=True, exist_ok=True)
    if plan is Plan.GROW:
        return _grow(cassette, argv, policy)
    if plan is Plan.ANEW:
        temp = beside(cassette)
        where = portable_launch(argv, Path.cwd(), cassette)["cassette"]
        session = RecordSession(temp, argv=argv, overwrite=True, header={"cassette": where})
        return Recording(session.start(), cassette, plan, temp=temp)
    if plan is Plan.REWRITE:
        cassette.unlink(missing_ok=True)
    return Recording(RecordSession(cassette, argv=argv, overwrite=True).start(), cassette, plan)


def _grow(cassette: Path, argv: list[str], policy: ReplayPolicy) -> Recording:
    """new_episodes: the cassette's log, served (and copied) while the test asks what it
    holds; at the first call it does not hold, live. Written beside the cassette, signed
    anew, so the cassette must verify here (unverified ones are refused)."""
    from replayer.continuation import ContinuationSession, signing_key
    from replayer.replay import ReplaySession

    ring = load_keyring(create=False)
    loaded = load(cassette, keyring=ring, require_signature=True, allow_unverified=False)
    signing = ring.signing or signing_key(loaded, ring)
    header = {k: v for k, v in loaded.header.items() if k not in ("format", "key_id")}
    launch = portable_launch(argv, Path.cwd(), cassette)
    redaction = Redaction.from_header(loaded.header.get("redact"))
    header.update(run=new_run_id(), created=utc_stamp(), argv=redaction.argv(launch["argv"]),
                  cwd=launch["cwd"], cassette=launch["cassette"])
    fsync = str(loaded.header.get("fsync") or "turn")
    temp = beside(cassette)
    writer = CassetteWriter(temp, header, signing, fsync, overwrite=True)
    try:
        log = ReplaySession(loaded, on_miss="pass", copies=True, policy=policy)
        empty = dataclasses.replace(loaded, observations=(), end=None)
        session = ContinuationSession(empty, writer, sources=[log], mode="record",
                                      keyring=ring, fsync=fsync).start()
    except BaseException:
        writer.abandon()
        temp.unlink(missing_ok=True)
        raise
    return Recording(session, cassette, Plan.GROW, temp=temp, source=log)
