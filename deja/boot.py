"""The bootstrap that records or replays an unmodified Python program from outside.

``deja record -- python agent.py`` runs the program with this package's ``_bootstrap``
directory first on PYTHONPATH and the session described in ``DEJA_*`` variables, the way
``opentelemetry-instrument`` and ``ddtrace-run`` work. At start-up Python imports
``sitecustomize``, which calls :func:`start_from_env`. It fails loudly: if the session
cannot start, the program does not run (exit status 3) and stderr says why.

The variables are removed from the environment once read, so programs that the agent
starts are not recorded into the same file.

A stop signal (SIGTERM, SIGHUP, SIGINT) that comes while the bootstrap runs is held until
the session has started: an exception raised inside ``sitecustomize`` would end Python
with "Fatal Python error" and leave the run without an end line. The launcher starts the
interpreter with those signals blocked (``DEJA_SIGNALS_HELD``), so none lands before this
module can take it either; the boot unblocks them once its own handler is in place. A
signal held so is acted on as soon as the session has started: the run ends
``interrupted``, with its end line, and the program exits 128 + N without running.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any, NoReturn

BOOT_DIR = Path(__file__).parent / "_bootstrap"
BOOT_FAILED = 3
_ENV = ("DEJA_MODE", "DEJA_CASSETTE", "DEJA_RUN_ID", "DEJA_ARGV", "DEJA_FSYNC", "DEJA_LABELS",
        "DEJA_REDACT_HEADERS", "DEJA_REDACT_BODY", "DEJA_REDACT_PATTERNS", "DEJA_REDACT_QUERY",
        "DEJA_REPORT", "DEJA_ALLOW_TORN", "DEJA_ALLOW_INCOMPLETE",
        "DEJA_REQUIRE_SIGNATURE", "DEJA_OVERWRITE", "DEJA_PLAN", "DEJA_BUDGETS", "DEJA_LOOP",
        "DEJA_BREAKER", "DEJA_ALLOW_UNVERIFIED", "DEJA_LAUNCHER_PID", "DEJA_LOCK_FD",
        "DEJA_LOCK_CASSETTE", "DEJA_SIGNALS_HELD")
# The signals that stop a run (the launcher passes them on), held while the boot runs.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
SIGNALS_HELD_ENV = "DEJA_SIGNALS_HELD"


def child_env(mode: str, **values: Any) -> dict[str, str]:
    """The environment for a program to be recorded or replayed (used by the CLI)."""
    env = {k: v for k, v in os.environ.items() if k not in _ENV}
    env["DEJA_MODE"] = mode
    if mode == "replay":  # nothing reaches the network: a client needs no real key
        from recorder.providers import placeholder_keys

        env.update(placeholder_keys(env))
    for key, value in values.items():
        if value is None:
            continue
        name = f"DEJA_{key.upper()}"
        env[name] = value if isinstance(value, str) else json.dumps(value)
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(BOOT_DIR) + (os.pathsep + path if path else "")
    return env


def _take_env() -> dict[str, str]:
    values = {k: os.environ.pop(k) for k in _ENV if k in os.environ}
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
             if p and Path(p) != BOOT_DIR]
    if parts:
        os.environ["PYTHONPATH"] = os.pathsep.join(parts)
    else:
        os.environ.pop("PYTHONPATH", None)
    return values


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
    env = _take_env()
    mode = env.get("DEJA_MODE")
    if mode is None:
        _chain_sitecustomize()
        return
    os.environ["DEJA_MODE"] = mode  # the program may ask (recorder.mode() in Python)
    held = _hold_signals(env)
    try:
        _adopt_lock(env)
        if mode == "record":
            watch = _start_record(env)
        elif mode == "replay":
            watch = _start_replay(env)
        elif mode in ("fork", "resume"):
            watch = _start_continuation(mode, env)
        else:
            _fail(f"unknown DEJA_MODE {mode!r} (expected record, replay, fork or resume)")
    except Exception as exc:  # noqa: BLE001 - reported and fatal, never swallowed
        from recorder.errors import EXIT_CASSETTE_UNWRITABLE, CassetteWriteError

        _fail(f"could not start {mode}: {type(exc).__name__}: {exc}",
              EXIT_CASSETTE_UNWRITABLE if isinstance(exc, CassetteWriteError) else BOOT_FAILED)
    _chain_sitecustomize()
    _stop_on_signals()
    if held:  # the run has started: it ends here, interrupted, before the program runs
        _stop_now(watch, held[0])


def _hold_signals(env: dict[str, str]) -> list[int]:
    """Until :func:`_stop_on_signals` takes over, a stop signal is noted, not raised; the
    list returned holds it. Signals the launcher blocked for us are let in now."""
    held: list[int] = []

    def note(signum: int, frame: Any) -> None:
        if not held:
            held.append(signum)

    for signum in STOP_SIGNALS:
        signal.signal(signum, note)
    if env.get(SIGNALS_HELD_ENV) == "1":
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
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


def _adopt_lock(env: dict[str, str]) -> None:
    """Hold the cassette's writer lock that the launcher took and handed down."""
    if "DEJA_LOCK_FD" in env:
        from recorder.cassette import lock

        lock.adopt(env["DEJA_LOCK_CASSETTE"], int(env["DEJA_LOCK_FD"]))


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


def _orphaned(env: dict[str, str]) -> bool:
    """The launcher that was to write our end line is gone (it was killed)."""
    launcher = env.get("DEJA_LAUNCHER_PID")
    return launcher is not None and os.getppid() != int(launcher)


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
        from recorder.errors import CassetteWriteError, Divergence, Interrupted, RunStopped

        self.error = value
        stop = _in_chain(value, (RunStopped, CassetteWriteError))
        if isinstance(value, Interrupted):  # a signal deja passed on: not the program's bug
            sys.stderr.write(f"deja: {value}" + ("\n" if self._mode == "replay" else
                             "; the run ends interrupted (deja resume continues it)\n"))
        elif stop is not None:
            sys.stderr.write(f"deja: {type(stop).__name__}: {stop}\n")
        elif self._mode == "record":
            self._previous(kind, value, tb)
        elif isinstance(value, Divergence):
            if self._mode != "replay":  # deja replay prints it in its report
                sys.stderr.write(f"deja: {type(value).__name__}: {value}\n")
        else:
            self._previous(kind, value, tb)


def _in_chain(error: BaseException,
              kinds: tuple[type[BaseException], ...]) -> BaseException | None:
    """``error``, or the exception it was raised from or during (an SDK wraps what its
    transport raised), that is one of ``kinds``."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, kinds):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def _start_record(env: dict[str, str]) -> _ExitWatch:
    from recorder.record import RecordSession

    argv = json.loads(env["DEJA_ARGV"]) if "DEJA_ARGV" in env else None
    rec = RecordSession(
        env.get("DEJA_CASSETTE", "cassettes"), run_id=env.get("DEJA_RUN_ID"), argv=argv,
        fsync=env.get("DEJA_FSYNC"), labels=json.loads(env.get("DEJA_LABELS", "{}")),
        redact_headers=tuple(json.loads(env.get("DEJA_REDACT_HEADERS", "[]"))),
        redact_body=tuple(json.loads(env.get("DEJA_REDACT_BODY", "[]"))),
        redact_patterns=tuple(json.loads(env.get("DEJA_REDACT_PATTERNS", "[]"))),
        redact_query=tuple(json.loads(env.get("DEJA_REDACT_QUERY", "[]"))),
        overwrite=env.get("DEJA_OVERWRITE") == "1",
        budgets=json.loads(env["DEJA_BUDGETS"]) if "DEJA_BUDGETS" in env else None,
        loop_guard=False if env.get("DEJA_LOOP") == "0" else None,
        breaker=False if env.get("DEJA_BREAKER") == "0" else None).start()
    watch = _ExitWatch()
    report = env.get("DEJA_REPORT")

    def finish() -> None:
        if report and not _orphaned(env):  # the launcher writes the end line, knowing the
            _write_report(report, {"end": rec.hand_over(watch.error),  # exit status
                                   "signal": watch.signal})
        else:
            rec.close(error=watch.error)

    atexit.register(finish)
    return watch


def _start_replay(env: dict[str, str]) -> _ExitWatch:
    from replayer.replay import start

    session = start(env["DEJA_CASSETTE"], allow_torn=env.get("DEJA_ALLOW_TORN") == "1",
                    allow_incomplete=env.get("DEJA_ALLOW_INCOMPLETE") == "1",
                    require_signature=env.get("DEJA_REQUIRE_SIGNATURE") == "1",
                    allow_unverified=env.get("DEJA_ALLOW_UNVERIFIED") == "1", progress=True)
    report = env.get("DEJA_REPORT")
    watch = _ExitWatch("replay")

    def finish() -> None:
        from recorder.errors import Divergence

        result = session.finish().to_dict()
        error = watch.error
        if error is not None and not isinstance(error, Divergence):  # the program's own
            result["program_error"] = f"{type(error).__name__}: {error}"[:500]
        if report:
            Path(report).write_text(json.dumps(result, default=str))

    atexit.register(finish)
    return watch


def _start_continuation(mode: str, env: dict[str, str]) -> _ExitWatch:
    from recorder.cassette import load
    from recorder.cassette.keys import load_keyring
    from replayer import continuation
    from replayer.fork import plan_fork, start_fork
    from replayer.resume import plan_resume, start_resume

    plan = json.loads(env["DEJA_PLAN"])
    if mode == "fork":
        fork_plan = plan_fork(plan["cassette"], plan["at"], patch=plan["patch"],
                              out=plan["out"], run_id=plan["run_id"],
                              allow_torn=bool(plan.get("allow_torn")))
        then = (load(plan["then_replay"], keyring=load_keyring(create=False),
                     require_signature=True, allow_incomplete=True)
                if plan.get("then_replay") else None)
        context = continuation.scope(  # the fork's command runs here (the recorded
            lambda: start_fork(fork_plan, then_replay=then, ran_in=Path.cwd()),  # directory,
            abandon_on_divergence=False, name="deja fork")  # or --cwd)
    else:
        loaded = plan_resume(plan["cassette"])
        context = continuation.scope(lambda: start_resume(loaded), abandon_on_divergence=True,
                                     name="deja resume")
    session = context.__enter__()
    # gone once the recorded steps are served and the run goes live
    session.prefix.show_progress(f"{mode}: replaying the recorded steps")
    watch = _ExitWatch(mode)
    report = env["DEJA_REPORT"]

    def finish() -> None:
        from recorder.errors import Divergence

        session.prefix.stop_progress()
        error = watch.error
        if isinstance(error, Divergence) and mode == "resume":
            session.abandon()  # the log stays resumable by a fixed agent
            _write_report(report, {"end": None, "diverged": str(error)})
        elif _orphaned(env):
            session.close(error=error)
        else:
            _write_report(report, {"end": session.hand_over(error), "signal": watch.signal})

    atexit.register(finish)
    return watch


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
