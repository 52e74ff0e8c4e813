"""Fixtures of the proxy tests: proxies run as real processes, stopped when a test ends."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from proxy_helpers import ProxyProcess, start_proxy


@pytest.fixture
def proxy(tmp_path: Path) -> Iterator[Callable[..., ProxyProcess]]:
    """``proxy(*args, env=None, workdir=None)`` starts ``deja proxy ARGS`` (in ``tmp_path``
    unless told otherwise); every proxy still running when the test ends is stopped."""
    started: list[ProxyProcess] = []

    def start(*args: str, env: dict[str, str] | None = None,
              workdir: Path | None = None) -> ProxyProcess:
        p = start_proxy(workdir or tmp_path, *args, env=env)
        started.append(p)
        return p

    yield start
    for p in started:
        if p.process.poll() is None:
            p.stop(signal.SIGKILL)
