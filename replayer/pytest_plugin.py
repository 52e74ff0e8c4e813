"""pytest plugin (registered as ``deja``): run a test against a cassette.

::

    @pytest.mark.deja("cassettes/incident-4312.jsonl")
    def test_agent_handles_malformed_search():
        assert run_agent() == "gave up cleanly"

The test replays the cassette offline; when the agent's code no longer makes the recorded
calls the test fails with deja's report (the step, the reason, the diff of the recorded
and the replayed request), not a traceback through the SDK.

What a test does with its cassette is its **record mode** (vcrpy's names), given by
``--deja-record-mode``:

=============  ==============================================  ========================
mode           the cassette exists                             it does not
=============  ==============================================  ========================
none           replayed                                        the test fails
                                                               (``CassetteNotFound``)
once           replayed                                        recorded
new_episodes   replayed; from the first call it does not       recorded
               hold, live and recorded; the result replaces
               the file if the test passes
all            recorded anew; the result replaces the file     recorded
               if the test passes
rewrite        deleted first, then recorded (kept whatever     recorded
               the test's outcome)
=============  ==============================================  ========================

A test's mode is the first of: ``--deja-record-mode`` (``--deja-record`` is ``once``,
``--deja-rerecord`` is ``all``); the ``DEJA_RECORD_MODE`` environment variable; ``none``
when ``CI`` is set (not empty, ``false`` or ``0``): CI never records unless told so; the
marker's ``record_mode=``; the ``deja_config`` fixture's; ``once``.

- ``@pytest.mark.deja(path, record=False)`` is a cassette no mode ever writes: an
  incident, kept as it happened. It always replays (under ``new_episodes`` too: a new
  call fails the test instead of going live); a missing one fails the test.
- ``@pytest.mark.deja(path, ignore=[...], normalise=[...])`` is the replay policy
  (:class:`replayer.policy.ReplayPolicy`): JSON pointers left out of the match, and
  ``PATTERN=REPLACEMENT`` rewrites of the request's text (a date in a prompt). The
  project's ``[tool.deja.match]`` and what each provider declares volatile (tool-use
  ids, a user id, cache markers) add to it. A call that matches only under it is
  *equivalent*; the failure report of a divergence names its kind
  (:mod:`replayer.verdicts`).
- ``allowed_hosts=[...]``: while a test replays, a connection to any other host (a
  database driver, a raw socket, a client deja does not capture) fails it with
  :class:`replayer.network.NetworkBlocked`; nothing is allowed unless listed,
  ``localhost`` included.
- The ``deja_config`` fixture (override it in a ``conftest.py`` or a test module, as
  pytest-recording's ``vcr_config``) returns the defaults of the marker's ``record_mode``,
  ``allow_unverified``, ``ignore``, ``normalise`` and ``allowed_hosts``; the marker's own
  arguments win.

**A folder of incidents**: ``@pytest.mark.deja_suite("incidents/")`` makes one test
case per cassette of the folder (its ``*.jsonl``, sorted; relative to pytest's rootdir),
named by the file (``test_x[refund-1182]``), each replayed around the test's body as
``@pytest.mark.deja(cassette, record=False)`` would: an incident is never recorded. The
marker's other arguments (``ignore``, ``normalise``, ``allowed_hosts``,
``allow_unverified``) go to each case; the test may take ``deja_incident``, the
cassette's path.

A cassette recorded by the plugin stores the test itself as its command, ``python -m
pytest <the test's node id>`` (no deja flags), and the directory pytest ran in, so
``deja replay``, ``deja fork`` and ``deja resume`` run that one test again. Under them
(a session started from outside) the test runs in that session and the marker adds
nothing. The ``deja_session`` fixture gives the active session (``.mode`` is ``"record"``
or ``"replay"``; ``"record"`` under ``new_episodes``, which may go live).

The cassette's signature is checked before the test runs: a cassette that does not
verify fails the test; one signed with a key this machine does not have is refused too,
unless unverified cassettes are allowed (``pytest --deja-allow-unverified``,
``@pytest.mark.deja(path, allow_unverified=True)`` or ``DEJA_ALLOW_UNVERIFIED=1``: a CI
job that was never given the key). Such a test is marked in its report and the session
ends with a list of every cassette that was replayed NOT VERIFIED. ``new_episodes`` signs
the grown cassette anew, so it refuses an unverified one.

The replay starts once the test's own fixtures are set up, so a fixture may set the
environment it needs (``DEJA_OLD_KEYS``, a base URL) with ``monkeypatch``.

**A dry run** (``--deja-dry-run``, also ``--dry-run`` when no other plugin or initial
conftest has taken that name) goes with ``--deja-record-mode=all`` or ``rewrite``: each
marked test runs live and records into a temporary file, which is compared with its
cassette (:mod:`replayer.drift`: same, equivalent, or changed and which fields) and then
removed; no cassette is written. The session ends with a ``deja drift`` section, one line
per test, and each test's report carries the whole comparison. A changed answer does not
fail a test by itself: the test passes or fails by its own assertions, as it would live.
A cassette marked ``record=False`` replays as always.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from recorder.capture import session as _session
from recorder.errors import CassetteNotFound, ConfigError, Divergence
from replayer import _pytest_modes as _modes
from replayer.network import NetworkBlocked, SocketGuard

if TYPE_CHECKING:
    from replayer.policy import ReplayPolicy

__all__ = ["NetworkBlocked", "command_for", "deja_config", "deja_session"]

_MODES_HELP = (
    "How @pytest.mark.deja tests treat their cassettes. none: replay only (a missing "
    "cassette fails the test); once: record the missing ones, replay the others; "
    "new_episodes: replay, and from the first call a cassette does not hold go live and "
    "record the rest (the result replaces the cassette only if the test passes); all: "
    "record every cassette anew (the new file replaces the old only if the test passes); "
    "rewrite: as all, but the old file is deleted first, even if the test then fails "
    "(its own recording is left). Without this flag: DEJA_RECORD_MODE if set, else "
    "none when CI is set, else the marker's or deja_config's record_mode, else once. A "
    "cassette marked record=False is never recorded.")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("deja")
    group.addoption("--deja-record-mode", choices=_modes.MODES, default=None,
                    help=_MODES_HELP)
    group.addoption("--deja-record", action="store_true", default=False,
                    help="The same as --deja-record-mode=once.")
    group.addoption("--deja-rerecord", action="store_true", default=False,
                    help="The same as --deja-record-mode=all.")
    group.addoption("--deja-allow-unverified", action="store_true", default=False,
                    help="Replay cassettes signed with a key this machine does not have "
                         "(unchecked; each is listed as NOT VERIFIED at the end).")
    group.addoption("--deja-dry-run", action="store_true", default=False,
                    dest="deja_dry_run", help=_DRY_RUN_HELP)


_DRY_RUN_HELP = (
    "With --deja-record-mode=all or rewrite: run the marked tests live into temporary "
    "files and report, per cassette, whether the provider still answers the same (same, "
    "equivalent or changed, and which fields) in a 'deja drift' section; no cassette is "
    "written, and a changed answer fails a test only through its own assertions.")


@pytest.hookimpl(wrapper=True)
def pytest_load_initial_conftests(parser: pytest.Parser) -> Iterator[None]:
    """``--dry-run`` as a short name of ``--deja-dry-run``, added once every plugin and
    the initial conftests have added their options, and only if none took the name."""
    result = yield
    try:
        parser.getgroup("deja").addoption("--dry-run", action="store_true", default=False,
                                          dest="deja_dry_run",
                                          help="The same as --deja-dry-run.")
    except (ValueError, argparse.ArgumentError):
        pass  # another plugin's --dry-run: only --deja-dry-run is deja's
    return result


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "deja(cassette, record=True, record_mode=None, allow_unverified=False, "
                   "ignore=(), normalise=(), allowed_hosts=()): replay the test against "
                   "CASSETTE, or record it as --deja-record-mode says (none, once, "
                   "new_episodes, all, rewrite; default none on CI, else once); "
                   "record=False: never recorded by any mode; defaults from the "
                   "deja_config fixture")
    config.addinivalue_line(
        "markers", "deja_suite(folder, ignore=(), normalise=(), allowed_hosts=(), "
                   "allow_unverified=False): one test case per cassette of FOLDER (its "
                   "*.jsonl), each replayed as @pytest.mark.deja(cassette, record=False); "
                   "the test may take deja_incident, the cassette's path")
    _modes.run_mode(config)  # conflicting flags, or a bad DEJA_RECORD_MODE: said now
    config.stash[_DRY] = _modes.dry_run(config)  # without all or rewrite: said now
    config.stash[_UNVERIFIED] = []
    config.stash[_WRITTEN] = []
    config.stash[_DRIFTS] = []
    # A session started from outside (deja replay/fork/resume of a recorded test): the
    # tests run in it.
    config.stash[_OUTER] = _session.active()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """``@pytest.mark.deja_suite(folder)``: a case per cassette of the folder, each marked
    ``@pytest.mark.deja(cassette, record=False)`` and given as ``deja_incident``."""
    marker = metafunc.definition.get_closest_marker("deja_suite")
    if marker is None:
        return
    where = metafunc.definition.nodeid
    if metafunc.definition.get_closest_marker("deja") is not None:
        raise pytest.UsageError(f"{where}: @pytest.mark.deja_suite gives each case its "
                                "cassette; drop @pytest.mark.deja")
    given = marker.kwargs.get("folder") or (marker.args[0] if marker.args else None)
    if given is None:
        raise pytest.UsageError(f"{where}: @pytest.mark.deja_suite needs a folder, e.g. "
                                "@pytest.mark.deja_suite('incidents/')")
    folder = Path(given)
    if not folder.is_absolute():
        folder = Path(metafunc.config.rootpath) / folder
    cassettes = sorted(folder.glob("*.jsonl"))
    if not cassettes:
        raise pytest.UsageError(f"{where}: @pytest.mark.deja_suite({str(given)!r}): no "
                                "cassettes there (no *.jsonl files)")
    options = {k: v for k, v in marker.kwargs.items() if k != "folder"}
    cases = [pytest.param(path, id=path.stem,
                          marks=pytest.mark.deja(str(path), record=False, **options))
             for path in cassettes]
    if "deja_incident" not in metafunc.fixturenames:  # given to the test if it asks
        metafunc.fixturenames.append("deja_incident")
    metafunc.parametrize("deja_incident", cases)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Start a marked test's replay after its own fixtures (they may set the environment)."""
    for item in items:
        if item.get_closest_marker("deja") is not None:
            names = getattr(item, "fixturenames", None)
            if names is not None and "_deja_marked" not in names:
                names.append("_deja_marked")


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    _drift_summary(terminalreporter, config)
    written = config.stash.get(_WRITTEN, [])
    if written:
        terminalreporter.section("deja: cassettes written", bold=True)
        for nodeid, note in written:
            terminalreporter.line(f"{nodeid}: {note}")
    unverified = config.stash.get(_UNVERIFIED, [])
    if not unverified:
        return
    terminalreporter.section("deja: cassettes replayed NOT VERIFIED", yellow=True, bold=True)
    for nodeid, note in unverified:
        terminalreporter.line(f"{nodeid}: {note}", yellow=True)
    terminalreporter.line("Their signatures were not checked: these tests prove nothing about "
                          "what was recorded. Give this machine the signing key (DEJA_KEY or "
                          "DEJA_OLD_KEYS) to check them.", yellow=True)


def _drift_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """A dry run's ``deja drift`` section: each test's cassette and what was found."""
    if not config.stash.get(_DRY, False):
        return
    drifts = config.stash.get(_DRIFTS, [])
    changed = sum(1 for _, _, verdict in drifts if verdict == "changed")
    terminalreporter.section("deja drift", bold=True, red=bool(changed))
    for nodeid, note, verdict in drifts:
        terminalreporter.line(f"{nodeid}: {note}", red=verdict == "changed")
    counts = {v: sum(1 for _, _, x in drifts if x == v) for v in ("same", "equivalent")}
    terminalreporter.line(
        f"dry run: no cassette was written; {changed} changed, {counts['equivalent']} "
        f"equivalent, {counts['same']} same. A changed answer fails a test only through "
        "its own assertions.")


def _policy(nodeid: str, settings: _modes.Settings, root: Path) -> ReplayPolicy:
    """What may differ between the recording and the test's run: the project's
    ``[tool.deja.match]`` (the ``pyproject.toml`` at or above ``root``, pytest's rootdir),
    what each provider declares volatile, and the test's ``ignore=`` (JSON pointers) and
    ``normalise=`` (``PATTERN=REPLACEMENT`` items)."""
    from replayer.policy import ReplayPolicy

    try:
        marked = ReplayPolicy.parse(settings.ignore, settings.normalise)
    except ConfigError as exc:
        raise pytest.UsageError(f"{nodeid}: @pytest.mark.deja: {exc}") from None
    try:
        return ReplayPolicy.configured(marked, start=root)
    except ConfigError as exc:
        raise pytest.UsageError(f"{nodeid}: {exc}") from None


def _plan(request: pytest.FixtureRequest, settings: _modes.Settings) -> _modes.Plan:
    """What this run does with the test's cassette; a missing cassette that will not be
    recorded fails the test here, saying how to record it."""
    __tracebackhide__ = True
    cassette, shown = settings.cassette, settings.shown
    mode, why = _modes.mode_of(request.config, settings)
    plan = _modes.plan_for(mode, cassette.exists(), settings.record,
                           request.config.stash.get(_DRY, False))
    if plan is not _modes.Plan.REPLAY or cassette.exists():
        return plan
    if not settings.record:
        pytest.fail(f"{shown} does not exist, and the test is marked record=False (a "
                    "cassette no mode records, such as an incident): restore the file "
                    "(e.g. from version control) or drop record=False", pytrace=False)
    raise CassetteNotFound(
        f"{shown} does not exist, and the record mode is none ({why}), which only "
        "replays. Record it where the model can be reached: pytest --deja-record-mode=once "
        f"{request.node.nodeid} (or DEJA_RECORD_MODE=once), then commit the cassette",
        path=cassette)


def command_for(item: pytest.Item) -> list[str]:
    """The command that runs ``item`` alone: ``python -m pytest <file>::<test>``. The file
    is absolute here; the cassette's header stores it relative to the directory pytest
    ran in, as ``deja record`` stores any command."""
    _file, _, rest = item.nodeid.partition("::")
    target = f"{Path(str(item.path)).resolve()}" + (f"::{rest}" if rest else "")
    return [sys.executable, "-m", "pytest", target]


_CONTEXT = pytest.StashKey[object]()
_RECORDING = pytest.StashKey[_modes.Recording]()
_GUARD = pytest.StashKey[SocketGuard]()
_UNVERIFIED = pytest.StashKey[list[tuple[str, str]]]()
_WRITTEN = pytest.StashKey[list[tuple[str, str]]]()
_OUTER = pytest.StashKey[object]()
_REPORTED = pytest.StashKey[bool]()
_DRY = pytest.StashKey[bool]()
_DRIFTS = pytest.StashKey[list[tuple[str, str, str | None]]]()


@pytest.fixture(scope="module")
def deja_config() -> dict[str, Any]:
    """The defaults of the ``@pytest.mark.deja`` tests' arguments (``record_mode``,
    ``allow_unverified``, ``ignore``, ``normalise``, ``allowed_hosts``); none here.
    Override it in a ``conftest.py`` or a test module; the marker's own arguments win."""
    return {}


@pytest.fixture
def _deja_marked(request: pytest.FixtureRequest, deja_config: Any) -> Iterator[None]:
    marker = request.node.get_closest_marker("deja")
    outer = request.config.stash.get(_OUTER, None)
    if marker is None or (outer is not None and _session.active() is outer):
        yield
        return
    nodeid = request.node.nodeid
    settings = _modes.settings_of(nodeid, marker, deja_config, Path(request.config.rootpath))
    plan = _plan(request, settings)
    if plan is _modes.Plan.REPLAY:
        yield from _replayed(request, settings)
        return
    allowed = settings.allow_unverified or request.config.getoption("deja_allow_unverified")
    recording = _modes.start_recording(plan, settings.cassette, command_for(request.node),
                                       _policy(nodeid, settings, request.config.rootpath),
                                       allow_unverified=bool(allowed))
    request.node.stash[_RECORDING] = recording
    try:
        yield
    finally:  # normally finished at the end of the test's call, with its outcome
        if request.node.stash.get(_RECORDING, None) is not None:
            del request.node.stash[_RECORDING]
            _written(request.node, recording, recording.finish(None, ran=False))


def _written(item: pytest.Item, recording: _modes.Recording, note: str | None) -> None:
    """Note for the session's summary what became of the test's cassette (in a dry run,
    what its comparison found: the test's report carries the whole of it)."""
    if note is None:
        return
    shown = recording.target
    root = Path(item.config.rootpath)
    if shown.is_relative_to(root):
        shown = shown.relative_to(root)
    if recording.plan is not _modes.Plan.DRY:
        item.config.stash.setdefault(_WRITTEN, []).append((item.nodeid, f"{shown}: {note}"))
        return
    found = recording.drift
    verdict = found.verdict if found is not None else None
    item.config.stash.setdefault(_DRIFTS, []).append((item.nodeid, f"{shown}: {note}", verdict))
    item.user_properties.append(("deja_drift", verdict or note))
    item.add_report_section("call", "deja drift",
                            found.render() if found is not None else f"{shown}: {note}")


def _replayed(request: pytest.FixtureRequest, settings: _modes.Settings) -> Iterator[None]:
    """Replay the test's cassette around the test, with the network blocked."""
    from replayer.replay import replay

    node = request.node
    allowed = settings.allow_unverified or request.config.getoption("deja_allow_unverified")
    context = replay(settings.cassette, allow_unverified=True if allowed else None,
                     policy=_policy(node.nodeid, settings, request.config.rootpath))
    current = context.__enter__()
    if not current.cassette.verified:
        note = current.cassette.verify_note
        request.config.stash.setdefault(_UNVERIFIED, []).append((node.nodeid, note))
        node.user_properties.append(("deja_signature", note))
        node.add_report_section("setup", "deja", f"{settings.cassette}: {note}")
    node.stash[_CONTEXT] = context
    node.stash[_GUARD] = SocketGuard(settings.allowed_hosts, settings.shown).start()
    try:
        yield
    finally:
        # Normally finished at the end of the test's call (see below); this covers a test
        # that failed before or during setup.
        guard = node.stash.get(_GUARD, None)
        if guard is not None:
            del node.stash[_GUARD]
            guard.stop()
        if node.stash.get(_CONTEXT, None) is not None:
            del node.stash[_CONTEXT]
            context.__exit__(None, None, None)


def _finish_replay(item: pytest.Item, context: Any, exc: BaseException | None) -> str | None:
    """End the replay; deja's report of a divergence, to fail the test with (no traceback:
    its frames would be the SDK's). A test that failed before its first recorded call
    fails with its own error: the steps it never asked for say nothing about a change."""
    try:
        context.__exit__(type(exc) if exc else None, exc, exc.__traceback__ if exc else None)
    except Divergence:
        pass  # the result holds it
    result = context.result
    if result is None or result.divergence is None:
        return None
    if exc is not None and not isinstance(exc, Divergence) and result.steps_served == 0:
        item.add_report_section("call", "deja", (
            f"the test failed before its first recorded call ({type(exc).__name__}), so "
            f"nothing of {result.path} was served: its error is below"))
        return None
    message = str(result.report(advice=(
        "the agent's code or inputs changed since the cassette was recorded: fix the agent, "
        "re-record with pytest --deja-rerecord (--deja-record-mode=all; not for a "
        "record=False cassette), or fork the run at this step (deja fork) to test the "
        "change")))
    if exc is not None and not isinstance(exc, Divergence):
        message += f"\n  then the test failed: {type(exc).__name__}: {exc}"
    return message


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """Finish a replay (or a recording) inside the test's call, so that a divergence
    fails the test and a recording ends with the test's outcome."""
    error: BaseException | None = None
    try:
        result = yield
    except BaseException as exc:  # noqa: BLE001 - raised again below, once the replay ended
        error = exc
    # Outside the except block: a divergence's failure carries no chained traceback.
    _end_of_call(item, error)
    if error is not None:
        raise error
    return result


def _end_of_call(item: pytest.Item, error: BaseException | None) -> None:
    recording = item.stash.get(_RECORDING, None)
    if recording is not None:
        del item.stash[_RECORDING]
        _written(item, recording, recording.finish(error))
    guard = item.stash.get(_GUARD, None)
    blocked = guard.stop() if guard is not None else []
    if guard is not None:
        del item.stash[_GUARD]
    context = item.stash.get(_CONTEXT, None)
    report = None
    if context is not None:
        del item.stash[_CONTEXT]
        report = _finish_replay(item, context, error)
    if blocked and not isinstance(error, NetworkBlocked):
        # The program caught the refusal (a client that retries, a bare except): the test
        # fails all the same, with what was blocked first and what followed.
        message = f"{type(blocked[0]).__name__}: {blocked[0]}"
        if len(blocked) > 1:
            message += f"\n  ({len(blocked) - 1} more connection(s) blocked)"
        report = message + (f"\n  and then {report}" if report else "")
    elif isinstance(error, NetworkBlocked) and report:
        # The blocked connection is the failure; the steps it kept the run from are below.
        item.add_report_section("call", "deja", report)
        report = None
    if report is not None:
        item.stash[_REPORTED] = True
        pytest.fail(report, pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Keep the short summary of a divergence to its first line. pytest prints a failure's
    whole message there on CI (where it does not trim to the terminal's width), which
    would print deja's report and its diff a second time."""
    report = yield
    if call.when == "call" and report.failed and item.stash.get(_REPORTED, False):
        crash = getattr(report.longrepr, "reprcrash", None)
        if crash is not None and "\n" in crash.message:
            crash.message = crash.message.splitlines()[0]
    return report


@pytest.fixture
def deja_session(_deja_marked: None) -> _session.Session:
    """The session of a ``@pytest.mark.deja`` test."""
    current = _session.active()
    if current is None:
        raise pytest.UsageError("deja_session needs the test to be marked @pytest.mark.deja")
    return current
