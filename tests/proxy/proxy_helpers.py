"""Running ``deja proxy`` as a real process from the proxy tests.

:func:`start_proxy` launches ``python -m deja proxy --port 0 --ready-file ...`` with the
test's environment (its key home and signing key), waits until the proxy listens, and
returns a :class:`ProxyProcess`: its URL, and :meth:`ProxyProcess.stop`, which sends a
signal and returns the exit status and everything the proxy logged. The ``proxy``
fixture of ``conftest.py`` stops every proxy a test started. What it recorded:
:func:`cassettes` in a ``--dir``, :func:`load_verified` one of them, checked against the
test's keys, and :func:`lines` its observations.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recorder.cassette import Cassette, load
from recorder.cassette.keys import load_keyring


@dataclass
class ProxyProcess:
    process: subprocess.Popen[bytes]
    url: str
    log_path: Path
    ready: dict[str, Any]
    returncode: int | None = field(default=None)

    @property
    def pid(self) -> int:
        return self.process.pid

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> tuple[int, str]:
        """Signal the proxy, wait for it to exit; (exit status, its log)."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            self.returncode = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.returncode = self.process.wait()
            raise AssertionError(f"deja proxy did not exit {timeout}s after signal {sig}:\n"
                                 f"{self.log()}") from None
        return self.returncode, self.log()


def start_proxy(workdir: Path, *args: str, env: dict[str, str] | None = None,
                timeout: float = 30.0) -> ProxyProcess:
    """Start ``deja proxy ARGS`` in ``workdir`` on a free port and wait until it listens."""
    workdir.mkdir(parents=True, exist_ok=True)
    n = len(list(workdir.glob("proxy-*.log")))
    ready = workdir / f"proxy-{n}.ready"
    log_path = workdir / f"proxy-{n}.log"
    ready.unlink(missing_ok=True)
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "deja", "proxy", "--port", "0", "--ready-file", str(ready),
             *args], cwd=workdir, stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready.is_file():
            data = json.loads(ready.read_text())
            return ProxyProcess(process, data["url"], log_path, data)
        if process.poll() is not None:
            raise AssertionError(f"deja proxy exited with {process.returncode} before it "
                                 f"listened:\n{log_path.read_text()}")
        time.sleep(0.02)
    process.kill()
    process.wait()
    raise AssertionError(f"deja proxy did not listen within {timeout}s:\n{log_path.read_text()}")


def run_proxy(workdir: Path, *args: str, env: dict[str, str] | None = None,
              timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """Run ``deja proxy ARGS`` to completion (for arguments it refuses before listening)."""
    return subprocess.run([sys.executable, "-m", "deja", "proxy", *args], cwd=workdir,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def cassettes(directory: Path) -> list[Path]:
    return sorted(directory.glob("r_*.jsonl"))


def load_verified(path: Path) -> Cassette:
    """The cassette at ``path``, whose signature must verify with the test's keys."""
    cassette = load(path, keyring=load_keyring(create=False), allow_unverified=False)
    assert cassette.verified, cassette.verify_note
    return cassette


def lines(cassette: Cassette) -> list[dict[str, Any]]:
    """The cassette's observations, as plain dicts."""
    return [dict(o) for o in cassette.observations]
