"""``deja wait``: wait, in a script, for what a background command has yet to do.

A server started with ``&`` is not listening yet when the next line runs, and a recording
started with ``&`` has made no call yet: a script (a README block pasted into a shell,
a CI job) that uses either at once fails, or proves nothing. ``deja wait PORT`` (or a URL,
or HOST:PORT) returns once something accepts a connection there; ``deja wait CASSETTE
--steps N`` once the cassette holds N steps or has ended, and ``deja wait CASSETTE`` once it
has ended. Each polls, and gives up after ``--timeout`` seconds with exit status 1.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

import click

from deja._common import BadInput

POLL = 0.05  # seconds between two looks


def _address(target: str) -> tuple[str, int] | None:
    """(host, port) of a port number, HOST:PORT or URL; None when ``target`` is none."""
    if target.isdigit():
        return "127.0.0.1", int(target)
    if "://" in target:
        parts = urlsplit(target)
        if parts.hostname and parts.scheme in ("http", "https"):
            return parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
        return None
    host, _, port = target.rpartition(":")
    return (host, int(port)) if host and port.isdigit() else None


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def _steps(path: Path) -> tuple[int, bool]:
    """(steps written, ended) of a cassette being written: its whole lines after the
    header, the end line not counted. Read as a status is: never trusted, only counted."""
    from recorder.cassette.reader import peek_end

    try:
        whole = path.read_bytes().count(b"\n")
    except OSError:
        return 0, False
    ended = peek_end(path) is not None  # an end line appended meanwhile ends the wait
    return max(0, whole - 1 - ended), ended


@click.command()
@click.argument("target")
@click.option("--steps", type=click.IntRange(min=1), default=None, metavar="N",
              help="TARGET is a cassette: wait until it holds N steps (or has ended); "
                   "without it, a cassette (*.jsonl) is waited for until it has ended.")
@click.option("--timeout", type=click.FloatRange(min=0), default=60.0, show_default=True,
              help="Give up after this many seconds (exit status 1).")
def wait(target: str, steps: int | None, timeout: float) -> None:
    """Wait for a server to listen, or a recording to get somewhere.

    deja wait 8765 (or http://127.0.0.1:8765, or HOST:PORT): until something accepts a
    connection there, e.g. after `deja stub --port 8765 &`. deja wait CASSETTE --steps N:
    until the run's cassette holds N steps or has ended, e.g. before killing a run on
    purpose; deja wait CASSETTE: until it has ended. Exit 0 once it is so, 1 when
    --timeout passes first.
    """
    deadline = time.monotonic() + timeout
    if steps is not None or target.endswith(".jsonl") or Path(target).is_file():
        path = Path(target)

        def ready() -> bool:
            done, ended = _steps(path)
            return ended or (steps is not None and done >= steps)

        what = f"{path} to hold {steps} steps" if steps else f"{path} to end"
    else:
        address = _address(target)
        if address is None:
            raise BadInput(f"{target!r} is neither a port, HOST:PORT nor an http(s) URL "
                           "(for a cassette, give --steps N)")
        host, port = address

        def ready() -> bool:
            return _listening(host, port)

        what = f"something to listen on {host}:{port}"
    while not ready():
        if time.monotonic() >= deadline:
            click.echo(f"deja: waited {timeout:g} s for {what}; giving up", err=True)
            raise SystemExit(1)
        time.sleep(POLL)
