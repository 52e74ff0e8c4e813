"""The bootstrap that records or replays an unmodified Python program from outside.

``deja record -- python agent.py`` runs the program with this package's ``_bootstrap``
directory first on PYTHONPATH and the session described in one variable, ``DEJA_LAUNCH``
(a :class:`recorder.launch.LaunchSpec`), the way ``opentelemetry-instrument`` and
``ddtrace-run`` work. At start-up Python imports ``sitecustomize``, which calls
:func:`start_from_env`. It fails loudly: if the session cannot start (or the spec is not
one this deja reads), the program does not run (exit status 3) and stderr says why in one
line.

The spec is removed from the environment once read, and the bootstrap from PYTHONPATH,
so programs that the agent starts are not recorded into the same file. ``DEJA_MODE`` stays:
the program (and what it starts) may ask what deja does with it.

A stop signal (SIGTERM, SIGHUP, SIGINT) that comes while the bootstrap runs is held until
the session has started: an exception raised inside ``sitecustomize`` would end Python
with "Fatal Python error" and leave the run without an end line. The launcher starts the
interpreter with those signals blocked (the spec's ``signals_held``), so none lands before this
module can take it either; the boot unblocks them once its own handler is in place. A
signal held so is acted on as soon as the session has started: the run ends
``interrupted``, with its end line, and the program exits 128 + N without running.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from recorder.launch import LaunchSpec

BOOT_DIR = Path(__file__).parent / "_bootstrap"
BOOT_FAILED = 3
LAUNCH_ENV = "DEJA_LAUNCH"  # the one variable the launcher tells the program its session in
MODE_ENV = "DEJA_MODE"  # what deja does with the program, for the program to read
ALLOW_UNVERIFIED_ENV = "DEJA_ALLOW_UNVERIFIED"  # the user's switch: the spec says it
# The signals that stop a run (the launcher passes them on), held while the boot runs.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


def child_env(mode: str, **values: Any) -> dict[str, str]:
    """The environment for a program to be recorded or replayed (used by the CLI): ours,
    the bootstrap first on PYTHONPATH, ``DEJA_MODE``, and the session in ``DEJA_LAUNCH``
    (``values`` are the fields of a :class:`recorder.launch.LaunchSpec`; None leaves a
    field at its default)."""
    from recorder.launch import LaunchMode, LaunchSpec

    spec = LaunchSpec(mode=LaunchMode(mode),
                      **{k: v for k, v in values.items() if v is not None})
    env = {k: v for k, v in os.environ.items() if k != ALLOW_UNVERIFIED_ENV}
    env[MODE_ENV] = spec.mode
    env[LAUNCH_ENV] = spec.encode()
    if spec.mode == "replay":  # nothing reaches the network: a client needs no real key
        from recorder.providers import placeholder_keys

        env.update(placeholder_keys(env))
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(BOOT_DIR) + (os.pathsep + path if path else "")
    return env


def _take_env() -> str | None:
    """The launch spec's text, taken out of the environment with the bootstrap's folder."""
    text = os.environ.pop(LAUNCH_ENV, None)
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
             if p and Path(p) != BOOT_DIR]
    if parts:
        os.environ["PYTHONPATH"] = os.pathsep.join(parts)
    else:
        os.environ.pop("PYTHONPATH", None)
    return text


def _fail(message: str, code: int = BOOT_FAILED) -> NoReturn:
    sys.stderr.write(f"deja: {message}\n")
    sys.stderr.flush()
    os._exit(code)


_booted = False  # once a process: a second copy of deja's bootstrap on sys.path is inert


def start_from_env() -> None:
    global _booted
    if _booted:
        return
    _booted = True
    text = _take_env()
    if text is None:
        _chain_sitecustomize()
        return
    held = _hold_signals()  # before anything is imported: reading the spec imports deja
    spec = _read_spec(text)
    if spec.signals_held:  # the launcher blocked them for us: let them in now
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    os.environ[MODE_ENV] = spec.mode  # the program may ask (recorder.mode() in Python)
    try:
        _adopt_lock(spec)
        if spec.mode == "record":
            watch = _start_record(spec)
        elif spec.mode == "replay":
            watch = _start_replay(spec)
        else:
            watch = _start_continuation(spec)
    except Exception as exc:  # noqa: BLE001 - reported and fatal, never swallowed
        from recorder.errors import EXIT_CASSETTE_UNWRITABLE, CassetteWriteError

        if spec.report and spec.mode in ("fork", "resume") and not _orphaned(spec):
            _report_not_started(spec.report, exc)  # the launcher: the run never started
        _fail(f"could not start {spec.mode}: {type(exc).__name__}: {exc}",
              EXIT_CASSETTE_UNWRITABLE if isinstance(exc, CassetteWriteError) else BOOT_FAILED)
    _chain_sitecustomize()
    _stop_on_signals()
    if held:  # the run has started: it ends here, interrupted, before the program runs
        _stop_now(watch, held[0])


def _read_spec(text: str) -> LaunchSpec:
    """The launch spec, or the program does not run: one line, exit status 3."""
    from recorder.errors import ConfigError
    from recorder.launch import LaunchSpec

    try:
        return LaunchSpec.decode(text)
    except ConfigError as exc:
        _fail(f"{LAUNCH_ENV}: {exc}")


def _hold_signals() -> list[int]:
    """Until :func:`_stop_on_signals` takes over, a stop signal is noted, not raised; the
    list returned holds it."""
    held: list[int] = []

    def note(signum: int, frame: Any) -> None:
        if not held:
            held.append(signum)

    for signum in STOP_SIGNALS:
        signal.signal(signum, note)
    return held


def _stop_now(watch: _ExitWatch, signum: int) -> NoReturn:
    """End the run that just started, as a signal to it would: ``interrupted``, its end
    line written (or handed over) by the usual exit handlers; exit 128 + N."""
    from recorder.capture.session import mark_stopping
    from recorder.errors import Interrupted

    mark_stopping()
    error = Interrupted(signum)
    watch.stopped(error)
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(128 + signum)


def _adopt_lock(spec: LaunchSpec) -> None:
    """Hold the cassette's writer lock that the launcher took and handed down."""
    if spec.lock_fd is not None:
        from recorder.cassette import lock

        lock.adopt(spec.lock_cassette or spec.cassette, spec.lock_fd)


def _stop_on_signals() -> None:
    """SIGTERM, SIGHUP and SIGINT (as the launcher passes them on) end the run at once,
    as ``Interrupted``, a KeyboardInterrupt: the run's end line says ``interrupted``.
    Signals that arrive while the run is already stopping are ignored."""
    from recorder.capture.session import mark_stopping
    from recorder.cassette.whole import interrupt
    from recorder.errors import Interrupted

    fired: list[int] = []

    def stop(signum: int, frame: Any) -> None:
        if fired:
            return
        fired.append(signum)
        mark_stopping()  # a response cut from here on is not logged: a resume asks again
        interrupt(Interrupted(signum))  # at once, or when the line being written is whole

    for signum in STOP_SIGNALS:
        signal.signal(signum, stop)


def _orphaned(spec: LaunchSpec) -> bool:
    """The launcher that was to write our end line is gone (it was killed)."""
    return spec.launcher_pid is not None and os.getppid() != spec.launcher_pid


class _ExitWatch:
    """Remembers an uncaught exception so the end line can say the run failed.

    deja's own verdicts are not the program's bugs and get no traceback, which would be
    mostly SDK frames: in any mode a harness stop (:class:`recorder.errors.RunStopped`:
    a budget, a cancel, the loop guard, the breaker) and a cassette that could not be
    written (:class:`recorder.errors.CassetteWriteError`: a full disk) are one line, also
    when the SDK raised them wrapped in its own error; so is a signal passed on by the
    launcher (:class:`recorder.errors.Interrupted`). Under a replay (``replay``, ``fork``
    and ``resume`` modes) an uncaught :class:`recorder.Divergence` is reported once, by
    ``deja replay`` (its report holds the divergence and its diff), or here as deja's
    message for a fork or a resume. Any other exception is the program's own and prints
    its traceback as usual.
    """

    def __init__(self, mode: str = "record") -> None:
        self.error: BaseException | None = None
        self._mode = mode
        self._previous = sys.excepthook
        sys.excepthook = self._hook

    @property
    def signal(self) -> int | None:
        """The signal that stopped the program (:class:`recorder.errors.Interrupted`)."""
        from recorder.errors import Interrupted

        return self.error.signum if isinstance(self.error, Interrupted) else None

    def stopped(self, error: BaseException) -> None:
        """The run stops with ``error`` before the program ran: said as the hook says it."""
        self._hook(type(error), error, None)

    def _hook(self, kind: type[BaseException], value: BaseException, tb: Any) -> None:
        from recorder.errors import (
            CassetteWriteError,
            CorruptCassette,
            Divergence,
            Interrupted,
            RunStopped,
        )
        from recorder.terminal import visible

        stop = _in_chain(value, (RunStopped, CassetteWriteError))
        # the run ends as the harness stopped it, also when the SDK wrapped the stop
        self.error = stop if isinstance(stop, RunStopped) else value
        corrupt = _in_chain(value, (CorruptCassette,), during=False)  # found when served
        if isinstance(value, Interrupted):  # a signal deja passed on: not the program's bug
            sys.stderr.write(f"deja: {value}" + ("\n" if self._mode == "replay" else
                             "; the run ends interrupted (deja resume continues it)\n"))
        elif stop is not None:
            sys.stderr.write(f"deja: {type(stop).__name__}: {stop}\n")
        elif self._mode == "record":
            self._previous(kind, value, tb)
        elif isinstance(value, Divergence) or corrupt is not None:
            if self._mode != "replay":  # deja replay prints it in its report
                shown = corrupt or value
                sys.stderr.write(visible(f"deja: {type(shown).__name__}: {shown}") + "\n")
        else:
            self._previous(kind, value, tb)


def _in_chain(error: BaseException, kinds: tuple[type[BaseException], ...], *,
              during: bool = True) -> BaseException | None:
    """``error``, or the exception it was raised from (``raise ... from``: an SDK wraps
    what its transport raised) or, with ``during``, raised while handling, that is one of
    ``kinds``. Without ``during``, a program's own bug in its handler stays the
    program's."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, kinds):
            return current
        seen.add(id(current))
        current = current.__cause__ or (current.__context__ if during else None)
    return None


def _start_record(spec: LaunchSpec) -> _ExitWatch:
    from recorder.record import RecordSession

    rec = RecordSession(
        spec.cassette, run_id=spec.run_id,
        argv=list(spec.argv) if spec.argv is not None else None, fsync=spec.fsync,
        labels=dict(spec.labels), redact_headers=spec.redact_headers,
        redact_body=spec.redact_body, redact_patterns=spec.redact_patterns,
        redact_query=spec.redact_query, overwrite=spec.overwrite, budgets=spec.budgets,
        loop_guard=None if spec.loop_guard else False,
        breaker=None if spec.breaker else False).start()
    watch = _ExitWatch()
    report = spec.report

    def finish() -> None:
        if report and not _orphaned(spec):  # the launcher writes the end line, knowing the
            _write_report(report, {"end": rec.hand_over(watch.error),  # exit status
                                   "signal": watch.signal})
        else:
            rec.close(error=watch.error)

    atexit.register(finish)
    return watch


def _start_replay(spec: LaunchSpec) -> _ExitWatch:
    from replayer.policy import ReplayPolicy
    from replayer.replay import start

    session = start(spec.cassette, allow_torn=spec.allow_torn,
                    allow_incomplete=spec.allow_incomplete,
                    require_signature=spec.require_signature,
                    allow_unverified=spec.allow_unverified, progress=True,
                    policy=ReplayPolicy.parse(spec.ignore, spec.normalise))
    report = spec.report
    watch = _ExitWatch("replay")

    def finish() -> None:
        from recorder.errors import DejaError, Divergence

        try:
            result = session.finish().to_dict()
        except DejaError as exc:  # a line found malformed only now, when it is restored
            if report:
                Path(report).write_text(json.dumps({"failed": {"error": type(exc).__name__,
                                                               "message": str(exc)}}))
                return
            raise
        error = watch.error
        if error is not None and not isinstance(error, Divergence):  # the program's own
            result["program_error"] = f"{type(error).__name__}: {error}"[:500]
        if report:
            Path(report).write_text(json.dumps(result, default=str))

    atexit.register(finish)
    return watch


def _start_continuation(spec: LaunchSpec) -> _ExitWatch:
    from recorder.cassette import load
    from recorder.cassette.keys import load_keyring
    from replayer import continuation
    from replayer.fork import plan_fork, start_fork
    from replayer.resume import plan_resume, start_resume
    from replayer.tool_policy import ToolPolicy

    mode = spec.mode
    if mode == "fork" and spec.then_live:
        context = continuation.scope(lambda: _then_live(spec), abandon_on_divergence=False,
                                     name="deja replay --then live")
    elif mode == "fork":
        if spec.at is None:
            raise ValueError("a fork's launch spec names no step (at)")
        fork_plan = plan_fork(spec.cassette, spec.at,
                              patch=list(spec.patch) if spec.patch is not None else None,
                              out=spec.out, run_id=spec.run_id, allow_torn=spec.allow_torn)
        then = (load(spec.then_replay, keyring=load_keyring(create=False),
                     require_signature=True, allow_incomplete=True)
                if spec.then_replay else None)
        context = continuation.scope(  # the fork's command runs here (the recorded
            lambda: start_fork(fork_plan, then_replay=then, ran_in=Path.cwd(),  # directory,
                               tools=ToolPolicy.parse(spec.tools)),  # or --cwd)
            abandon_on_divergence=False, name="deja fork")
    else:
        loaded = plan_resume(spec.cassette)
        context = continuation.scope(lambda: start_resume(loaded, resend=spec.resend),
                                     abandon_on_divergence=True, name="deja resume")
    session = context.__enter__()
    # gone once the recorded steps are served and the run goes live
    session.prefix.show_progress(f"{mode}: replaying the recorded steps")
    watch = _ExitWatch(mode)
    report = spec.report

    def finish() -> None:
        from recorder.errors import Divergence

        session.prefix.stop_progress()
        error = watch.error
        if isinstance(error, Divergence) and mode == "resume":
            session.abandon()  # the log stays resumable by a fixed agent
            if report:
                _write_report(report, {"end": None, "diverged": str(error)})
        elif not report or _orphaned(spec):
            session.close(error=error)
        else:
            _write_report(report, {"end": session.hand_over(error), "signal": watch.signal})

    atexit.register(finish)
    return watch


def _then_live(spec: LaunchSpec) -> Any:
    """The session of ``deja replay --then live``: the cassette served while the program
    asks what it asked before, then live (:mod:`replayer.then_live`)."""
    from replayer.policy import ReplayPolicy
    from replayer.then_live import plan_then_live, start_then_live
    from replayer.tool_policy import ToolPolicy

    plan = plan_then_live(spec.cassette, out=spec.out, run_id=spec.run_id,
                          allow_incomplete=spec.allow_incomplete)
    return start_then_live(plan, policy=ReplayPolicy.parse(spec.ignore, spec.normalise),
                           tools=ToolPolicy.parse(spec.tools), ran_in=Path.cwd())


def _report_not_started(path: str, exc: BaseException) -> None:
    """Tell the launcher, whose child this process is, that the session never started,
    unless a report is there already. (A program that starts Python twice, a shell script,
    boots twice: the second boot's failure says nothing of the first's run.)"""
    tmp = Path(path + ".start")
    with contextlib.suppress(OSError):
        tmp.write_text(json.dumps({"not_started": f"{type(exc).__name__}: {exc}"}))
        os.link(tmp, path)  # whole, and only where there was none
    with contextlib.suppress(OSError):
        tmp.unlink()


def _write_report(path: str, data: dict[str, Any]) -> None:
    tmp = Path(path + ".tmp")
    tmp.write_text(json.dumps(data, default=str))
    os.replace(tmp, path)


def _is_bootstrap(folder: Path) -> bool:
    """Is ``folder`` deja's bootstrap, this installation's or another copy's (a checkout
    next to an installed deja)?"""
    folder = folder.resolve()
    return folder == BOOT_DIR.resolve() or (
        folder.name == BOOT_DIR.name and (folder.parent / "boot.py").is_file()
        and (folder / "sitecustomize.py").is_file())


def _chain_sitecustomize() -> None:
    """Run the sitecustomize this one shadows, if the environment has one."""
    from importlib.machinery import PathFinder
    from importlib.util import module_from_spec

    path = [p for p in sys.path if not _is_bootstrap(Path(p or "."))]
    spec = PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = module_from_spec(spec)
    sys.modules["_deja_chained_sitecustomize"] = module
    spec.loader.exec_module(module)
