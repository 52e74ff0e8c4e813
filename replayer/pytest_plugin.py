"""pytest plugin (registered as ``deja``): run a test against a cassette.

::

    @pytest.mark.deja("cassettes/incident-4312.jsonl")
    def test_agent_handles_malformed_search():
        assert run_agent() == "gave up cleanly"

By default the test replays the cassette offline and fails with ``Divergence`` if the
agent's code no longer makes the recorded calls. ``pytest --deja-record`` records the
cassette anew instead (live calls; the file is overwritten). The ``deja_session`` fixture
gives the active session (``.mode`` is ``"record"`` or ``"replay"``).

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

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from recorder import session as _session
from recorder.record import record


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("deja")
    group.addoption("--deja-record", action="store_true", default=False,
                    help="Record the cassettes of @pytest.mark.deja tests anew instead of "
                         "replaying them.")
    group.addoption("--deja-allow-unverified", action="store_true", default=False,
                    help="Replay cassettes signed with a key this machine does not have "
                         "(unchecked; each is listed as NOT VERIFIED at the end).")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "deja(cassette, allow_unverified=False): replay the test against "
                   "CASSETTE (record it with --deja-record)")
    config.stash[_UNVERIFIED] = []


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


_CONTEXT = pytest.StashKey[object]()
_UNVERIFIED = pytest.StashKey[list[tuple[str, str]]]()


@pytest.fixture
def _deja_marked(request: pytest.FixtureRequest) -> Iterator[None]:
    cassette = _cassette_of(request)
    if cassette is None:
        yield
        return
    if request.config.getoption("deja_record"):
        with record(cassette, overwrite=True):
            yield
        return
    from .replay import replay

    marker = request.node.get_closest_marker("deja")
    allowed = (bool(marker.kwargs.get("allow_unverified"))
               or request.config.getoption("deja_allow_unverified"))
    context = replay(cassette, allow_unverified=True if allowed else None)
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


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """Finish a replay inside the test's call, so that a divergence fails the test."""
    try:
        result = yield
    except BaseException as exc:
        context = item.stash.get(_CONTEXT, None)
        if context is not None:
            del item.stash[_CONTEXT]
            context.__exit__(type(exc), exc, exc.__traceback__)  # type: ignore[attr-defined]
        raise
    context = item.stash.get(_CONTEXT, None)
    if context is not None:
        del item.stash[_CONTEXT]
        context.__exit__(None, None, None)  # type: ignore[attr-defined]
    return result


@pytest.fixture
def deja_session(_deja_marked: None) -> _session.Session:
    """The session of a ``@pytest.mark.deja`` test."""
    current = _session.active()
    if current is None:
        raise pytest.UsageError("deja_session needs the test to be marked @pytest.mark.deja")
    return current
