"""pytest plugin (registered as ``deja``): run a test against a cassette.

::

    @pytest.mark.deja("cassettes/incident-4312.jsonl")
    def test_agent_handles_malformed_search():
        assert run_agent() == "gave up cleanly"

By default the test replays the cassette offline and fails with ``Divergence`` if the
agent's code no longer makes the recorded calls. ``pytest --deja-record`` records the
cassette anew instead (live calls; the file is overwritten). The ``deja_session`` fixture
gives the active session (``.mode`` is ``"record"`` or ``"replay"``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from recorder import session as _session
from recorder.record import record


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("deja")
    group.addoption("--deja-record", action="store_true", default=False,
                    help="Record the cassettes of @pytest.mark.deja tests anew instead of "
                         "replaying them.")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "deja(cassette): replay the test against CASSETTE (record it with "
                   "--deja-record)")


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


@pytest.fixture(autouse=True)
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

    context = replay(cassette)
    context.__enter__()
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
