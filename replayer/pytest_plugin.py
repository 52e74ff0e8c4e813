"""pytest plugin (registered as ``deja``): run a test against a cassette.

::

    @pytest.mark.deja("cassettes/incident-4312.jsonl")
    def test_agent_handles_malformed_search():
        assert run_agent() == "gave up cleanly"

By default the test replays the cassette offline; when the agent's code no longer makes
the recorded calls the test fails with deja's report (the step, the reason, the diff of
the recorded and the replayed request), not a traceback through the SDK.

Recording follows one rule: a flag never overwrites what it was not asked to.

- ``pytest --deja-record`` records the cassettes that do not exist yet (new tests) and
  replays the others.
- ``pytest --deja-rerecord`` records every marked cassette anew (live calls; the file is
  overwritten), except those marked ``record=False``.
- ``@pytest.mark.deja(path, record=False)`` is a cassette no flag ever writes: an
  incident, kept as it happened. It always replays; a missing one fails the test.
- ``@pytest.mark.deja(path, ignore=[...], normalise=[...])`` is the replay policy
  (:class:`replayer.policy.ReplayPolicy`): JSON pointers left out of the match, and
  ``PATTERN=REPLACEMENT`` rewrites of the request's text (a date in a prompt).

A cassette recorded by the plugin stores the test itself as its command, ``python -m
pytest <the test's node id>`` (no deja flags), and the directory pytest ran in, so
``deja replay``, ``deja fork`` and ``deja resume`` run that one test again. Under them
(a session started from outside) the test runs in that session and the marker adds
nothing. The ``deja_session`` fixture gives the active session (``.mode`` is ``"record"``
or ``"replay"``).

The cassette's signature is checked before the test runs: a cassette that does not
verify fails the test; one signed with a key this machine does not have is refused too,
unless unverified cassettes are allowed (``pytest --deja-allow-unverified``,
``@pytest.mark.deja(path, allow_unverified=True)`` or ``DEJA_ALLOW_UNVERIFIED=1``: a CI
job that was never given the key). Such a test is marked in its report and the session
ends with a list of every cassette that was replayed NOT VERIFIED.

The replay starts once the test's own fixtures are set up, so a fixture may set the
environment it needs (``DEJA_OLD_KEYS``, a base URL) with ``monkeypatch``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from recorder.capture import session as _session
from recorder.errors import ConfigError, Divergence
from recorder.record import RecordSession

if TYPE_CHECKING:
    from replayer.policy import ReplayPolicy


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("deja")
    group.addoption("--deja-record", action="store_true", default=False,
                    help="Record the cassettes of @pytest.mark.deja tests that do not exist "
                         "yet (new tests); the others replay.")
    group.addoption("--deja-rerecord", action="store_true", default=False,
                    help="Record every @pytest.mark.deja cassette anew (live calls, files "
                         "overwritten), except those marked record=False.")
    group.addoption("--deja-allow-unverified", action="store_true", default=False,
                    help="Replay cassettes signed with a key this machine does not have "
                         "(unchecked; each is listed as NOT VERIFIED at the end).")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "deja(cassette, allow_unverified=False, record=True): replay the test "
                   "against CASSETTE (--deja-record records it if it does not exist, "
                   "--deja-rerecord anew; record=False: never recorded by a flag)")
    config.stash[_UNVERIFIED] = []
    # A session started from outside (deja replay/fork/resume of a recorded test): the
    # tests run in it.
    config.stash[_OUTER] = _session.active()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Start a marked test's replay after its own fixtures (they may set the environment)."""
    for item in items:
        if item.get_closest_marker("deja") is not None:
            names = getattr(item, "fixturenames", None)
            if names is not None and "_deja_marked" not in names:
                names.append("_deja_marked")


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    unverified = config.stash.get(_UNVERIFIED, [])
    if not unverified:
        return
    terminalreporter.section("deja: cassettes replayed NOT VERIFIED", yellow=True, bold=True)
    for nodeid, note in unverified:
        terminalreporter.line(f"{nodeid}: {note}", yellow=True)
    terminalreporter.line("Their signatures were not checked: these tests prove nothing about "
                          "what was recorded. Give this machine the signing key (DEJA_KEY or "
                          "DEJA_OLD_KEYS) to check them.", yellow=True)


def _cassette_of(request: pytest.FixtureRequest) -> Path | None:
    marker = request.node.get_closest_marker("deja")
    if marker is None:
        return None
    if not marker.args and "cassette" not in marker.kwargs:
        raise pytest.UsageError(f"{request.node.nodeid}: @pytest.mark.deja needs a cassette "
                                "path, e.g. @pytest.mark.deja('cassettes/run.jsonl')")
    path = Path(marker.kwargs.get("cassette") or marker.args[0])
    return path if path.is_absolute() else Path(request.config.rootpath) / path


def _recordable(request: pytest.FixtureRequest) -> bool:
    """The marker's ``record=``: False for a cassette no flag may write."""
    value = request.node.get_closest_marker("deja").kwargs.get("record", True)
    if not isinstance(value, bool):
        raise pytest.UsageError(f"{request.node.nodeid}: @pytest.mark.deja(record=...) is "
                                f"True or False, not {value!r}")
    return value


def _policy(request: pytest.FixtureRequest, marker: pytest.Mark) -> ReplayPolicy:
    """The marker's ``ignore=`` (JSON pointers) and ``normalise=`` (``PATTERN=REPLACEMENT``
    items): what may differ between the recording and the test's run."""
    from replayer.policy import ReplayPolicy

    ignore, normalise = marker.kwargs.get("ignore", ()), marker.kwargs.get("normalise", ())
    if isinstance(ignore, str) or isinstance(normalise, str):
        raise pytest.UsageError(f"{request.node.nodeid}: @pytest.mark.deja(ignore=..., "
                                "normalise=...) take lists of strings")
    try:
        return ReplayPolicy.parse(ignore, normalise)
    except ConfigError as exc:
        raise pytest.UsageError(f"{request.node.nodeid}: @pytest.mark.deja: {exc}") from None


def _should_record(request: pytest.FixtureRequest, cassette: Path) -> bool:
    """Whether this run records ``cassette`` (see the module docstring for the rule)."""
    rerecord = request.config.getoption("deja_rerecord")
    new = request.config.getoption("deja_record") or rerecord
    if not _recordable(request):
        if not cassette.exists() and new:
            pytest.fail(f"{cassette} does not exist, and the test is marked record=False (a "
                        "cassette no flag records, such as an incident): restore the file "
                        "(e.g. from version control) or drop record=False", pytrace=False)
        return False
    return rerecord or (new and not cassette.exists())


def command_for(item: pytest.Item) -> list[str]:
    """The command that runs ``item`` alone: ``python -m pytest <file>::<test>``. The file
    is absolute here; the cassette's header stores it relative to the directory pytest
    ran in, as ``deja record`` stores any command."""
    _file, _, rest = item.nodeid.partition("::")
    target = f"{Path(str(item.path)).resolve()}" + (f"::{rest}" if rest else "")
    return [sys.executable, "-m", "pytest", target]


_CONTEXT = pytest.StashKey[object]()
_RECORDING = pytest.StashKey[RecordSession]()
_UNVERIFIED = pytest.StashKey[list[tuple[str, str]]]()
_OUTER = pytest.StashKey[object]()
_REPORTED = pytest.StashKey[bool]()


@pytest.fixture
def _deja_marked(request: pytest.FixtureRequest) -> Iterator[None]:
    cassette = _cassette_of(request)
    outer = request.config.stash.get(_OUTER, None)
    if cassette is None or (outer is not None and _session.active() is outer):
        yield
        return
    if _should_record(request, cassette):
        cassette.parent.mkdir(parents=True, exist_ok=True)
        rec = RecordSession(cassette, argv=command_for(request.node), overwrite=True).start()
        request.node.stash[_RECORDING] = rec
        try:
            yield
        finally:  # normally closed at the end of the test's call, with its outcome
            if request.node.stash.get(_RECORDING, None) is not None:
                del request.node.stash[_RECORDING]
                rec.close()
        return
    from replayer.replay import replay

    marker = request.node.get_closest_marker("deja")
    allowed = (bool(marker.kwargs.get("allow_unverified"))
               or request.config.getoption("deja_allow_unverified"))
    context = replay(cassette, allow_unverified=True if allowed else None,
                     policy=_policy(request, marker))
    current = context.__enter__()
    if not current.cassette.verified:
        note = current.cassette.verify_note
        request.config.stash.setdefault(_UNVERIFIED, []).append((request.node.nodeid, note))
        request.node.user_properties.append(("deja_signature", note))
        request.node.add_report_section("setup", "deja", f"{cassette}: {note}")
    request.node.stash[_CONTEXT] = context
    try:
        yield
    finally:
        # Normally finished at the end of the test's call (see below); this covers a test
        # that failed before or during setup.
        if request.node.stash.get(_CONTEXT, None) is not None:
            del request.node.stash[_CONTEXT]
            context.__exit__(None, None, None)


def _finish_replay(item: pytest.Item, context: Any, exc: BaseException | None) -> None:
    """End the replay; a divergence fails the test with deja's report as its message
    (no traceback: its frames would be the SDK's), the diff shown once. A test that failed
    before its first recorded call fails with its own error: the steps it never asked for
    say nothing about a change."""
    try:
        context.__exit__(type(exc) if exc else None, exc, exc.__traceback__ if exc else None)
    except Divergence:
        pass  # the result holds it
    result = context.result
    if result is None or result.divergence is None:
        return
    if exc is not None and not isinstance(exc, Divergence) and result.steps_served == 0:
        item.add_report_section("call", "deja", (
            f"the test failed before its first recorded call ({type(exc).__name__}), so "
            f"nothing of {result.path} was served: its error is below"))
        return
    message = result.report(advice=(
        "the agent's code or inputs changed since the cassette was recorded: fix the agent, "
        "re-record with pytest --deja-rerecord (not for a record=False cassette), or fork "
        "the run at this step (deja fork) to test the change"))
    if exc is not None and not isinstance(exc, Divergence):
        message += f"\n  then the test failed: {type(exc).__name__}: {exc}"
    pytest.fail(message, pytrace=False)


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
    rec = item.stash.get(_RECORDING, None)
    if rec is not None:
        del item.stash[_RECORDING]
        rec.close(error=error)
    context = item.stash.get(_CONTEXT, None)
    if context is not None:
        del item.stash[_CONTEXT]
        item.stash[_REPORTED] = True
        _finish_replay(item, context, error)


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
