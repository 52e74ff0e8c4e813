"""What ``deja record``, ``replay``, ``fork`` and ``resume`` share around running the
program (:mod:`deja.launcher`): the cassette's writer lock, the directory to run in, the
end line written once the program is gone, and what is reported of it afterwards."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import click

from deja._common import BadInput, _fail, _pid_gone, _python_argv


def _writer_lock(path: Path, run: str | None, what: str) -> Any:
    """Take ``path``'s writer lock for the whole command (refused: exit 2, naming who has it)."""
    import time

    from recorder.cassette import lock
    from recorder.errors import CassetteLocked, DejaError

    deadline = None
    while True:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            return lock.acquire(path, run=run, what=what)
        except OSError as exc:
            raise BadInput(f"cannot create {path.parent}: {exc.strerror or exc}") from None
        except CassetteLocked as exc:
            # A launcher killed outright leaves its program closing the run (its
            # parent-death signal): wait for that, never for a live run.
            if not _orphaned_holder(exc.holder) or (deadline and time.monotonic() > deadline):
                _fail(exc)
            if deadline is None:
                deadline = time.monotonic() + 15
                click.echo(f"deja: waiting for pid {exc.holder.get('child')}, whose launcher "
                           "was killed, to close the run", err=True)
            time.sleep(0.1)
        except DejaError as exc:
            _fail(exc)


def _orphaned_holder(holder: dict[str, Any]) -> bool:
    """The lock is held by a program whose launcher (on this host) is gone."""
    import socket

    if holder.get("host") != socket.gethostname() or not holder.get("child"):
        return False
    return _pid_gone(holder.get("pid"))


def _where_to_run(cassette: Path, header: Mapping[str, Any], argv: list[str], *, given: bool,
                  cwd: Path | None) -> Path | None:
    """The directory to run a recorded (or given) command in; a command that cannot start
    there exits 2 (it is not a divergence), naming the directory and what to do."""
    from recorder.errors import CannotLaunch
    from recorder.launch import launch_dir, startable

    advice = (f"give the project directory with --cwd DIR, or the command after --: "
              f"deja {click.get_current_context().info_name} {cassette} -- {' '.join(argv)}")
    if cwd is None and not given:
        try:
            cwd = launch_dir(cassette, header)
        except CannotLaunch as exc:
            raise BadInput(f"the recorded command ({' '.join(argv)}) cannot be run: {exc}; "
                           f"{advice}") from None
    why = startable(argv, cwd or Path.cwd())
    if why is not None:
        what = "the command" if given else "the recorded command"
        raise BadInput(f"{what} ({' '.join(argv)}) cannot start in {cwd or Path.cwd()}: {why}. "
                       "Nothing was run. " + ("Check the command" if given else advice))
    return cwd


class Launched(NamedTuple):
    """How a launched program ended: the status to exit with, and whether its session
    started (False: deja's bootstrap could not start a fork or resume, and said why; the
    program did not run)."""

    status: int
    started: bool = True


def _launch(mode: str, command: list[str], target: Path, cwd: Path | None, *,
            lock: Any = None, **values: Any) -> Launched:
    """Run a program under the bootstrap, its session the launch spec ``mode`` and
    ``values`` make (:class:`recorder.launch.LaunchSpec`); write the end line it hands
    back, with its exit status. A program killed before handing over leaves its run open:
    resumable.
    Returns the status to exit with (128 + N when a signal N stopped it), and whether the
    session started (:class:`Launched`)."""
    from deja import launcher
    from deja.boot import BOOT_FAILED, child_env
    from recorder.ask import EXIT_INPUT_REQUIRED, WORKER_ENV
    from recorder.errors import EXIT_CASSETTE_UNWRITABLE, CassetteWriteError, DejaError
    from recorder.launch import write_end

    with tempfile.TemporaryDirectory(prefix="deja-") as tmp:
        report = Path(tmp) / "report.json"
        env = child_env(mode, report=str(report), **values)
        try:
            ended = launcher.run(_python_argv(command), env=env, cwd=cwd, lock=lock)
        except OSError as exc:
            raise BadInput(f"cannot run {command[0]!r}: {exc.strerror or exc}") from None
        status = ended.status
        handed = json.loads(report.read_text()) if report.exists() else None
        if handed is not None and "not_started" in handed:  # the bootstrap said why
            return Launched(status, started=False)
        if handed is not None:
            end = handed.get("end")
            handed_status = end.get("status") if end is not None else None
            killed_by = ended.received if ended.received is not None else \
                ended.code - 128 if ended.code > 128 else None
            if end is not None and end.get("status") == "completed" and \
                    killed_by is not None and ended.code != 0:
                # Every step was logged, but a signal stopped the program on its way out
                # (through us, or sent to the program alone: the out-of-memory killer):
                # resumable (a resume replays it all and closes the run), not a failure.
                end = dict(end, status="interrupted",
                           reason=f"signal {killed_by} as the program exited")
            if end is not None and end.get("status") == "interrupted" and \
                    ended.received is None and isinstance(handed.get("signal"), int):
                # The signal went to the program alone (not through us): as a shell
                # reports a program stopped by signal N, 128 + N, not Python's exit 1.
                status = 128 + handed["signal"]
            if end is not None:
                try:
                    write_end(target, end, 0 if ended.received is not None and
                              end.get("status") == "completed" else status,
                              handed=handed_status)
                except CassetteWriteError as exc:  # still no room: the run stays open
                    click.echo(f"deja: the run's end line could not be written ({exc})",
                               err=True)
                except DejaError as exc:
                    _fail(exc)
        elif ended.code == EXIT_INPUT_REQUIRED and os.environ.get(WORKER_ENV) == "1":
            click.echo("deja: the run waits for an answer (recorder.ask); it is resumed with "
                       "it", err=True)
        elif target.exists() and ended.code not in (BOOT_FAILED, EXIT_CASSETTE_UNWRITABLE):
            click.echo(f"deja: the program ended (status {ended.status}) before the run could "
                       f"be closed; it can be resumed: deja resume {target}", err=True)
    return Launched(status)


def _echo_split(path: Path) -> None:
    """What a fork or a resumed run replayed and what it spent live, on stderr."""
    from recorder.cassette import load
    from recorder.cassette.rows import describe_split, run_totals
    from recorder.errors import DejaError
    from recorder.terminal import visible

    try:
        split = describe_split(run_totals(load(path, allow_torn=True, allow_incomplete=True)))
    except DejaError:  # what went wrong was said above
        return
    for line in split:
        click.echo(visible(f"deja:   {line}"), err=True)
