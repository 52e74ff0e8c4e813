"""A run's launch: what a cassette's header says of how its run was started, and what a
launcher (``deja record``, ``replay``, ``fork``, ``resume``) does with it.

A new run's id; the software it ran with; its command and directory, stored so that a
checkout elsewhere can run it again (:func:`portable_launch`), and found again from where
the cassette lies (:func:`launch_dir`); whether that command can start at all
(:func:`startable`); what the launcher tells the program it starts (:class:`LaunchSpec`,
one serialised value in ``DEJA_LAUNCH``); and the end line a launcher writes for a program
that has exited (:func:`write_end`).

The launch spec is the whole protocol between a launcher and deja's bootstrap in the
program (``deja.boot``, which reads it from one variable, ``DEJA_LAUNCH``): one JSON
object, its ``version`` first, so that a program started by another deja's launcher is
refused with one line instead of half-reading a session::

    DEJA_LAUNCH={"version": 1, "mode": "record", "cassette": "/abs/run.jsonl",
                 "report": "/tmp/deja-x/report.json", "run_id": "r_...", ...}

Only what a user sets or a program reads stays a variable of its own: ``DEJA_MODE`` (set
for the program, in any language), ``DEJA_KEY``, ``DEJA_OLD_KEYS``, ``DEJA_HOME``,
``DEJA_CONFIG`` and ``DEJA_ALLOW_UNVERIFIED`` (read by the launcher, which passes its
decision on in the spec).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import importlib.metadata
import json
import os
import platform
import secrets
import sys
import time
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recorder.cassette import CassetteWriter, Fsync
from recorder.cassette.keys import Keyring, load_keyring
from recorder.cassette.schema import EndStatus, run_status
from recorder.errors import CannotLaunch, ConfigError

_PACKAGES = ("deja", "anthropic", "httpx2", "vcrpy")


def new_run_id() -> str:
    """Sortable by start time: ``r_`` + 12 hex digits of milliseconds + 8 random."""
    return f"r_{int(time.time() * 1000):012x}{secrets.token_hex(4)}"


@functools.cache
def _versions() -> dict[str, str]:
    """What the header records of the software that wrote it (read once per process: a
    recording proxy starts many runs)."""
    out = {"python": platform.python_version()}
    for name in _PACKAGES:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[name] = importlib.metadata.version(name)
    return out


def portable_launch(argv: list[str], cwd: Path, cassette: Path) -> dict[str, Any]:
    """How to re-launch the run, without this machine's paths where it can be helped.

    When the cassette lies under ``cwd`` (a cassette committed with its project), ``cwd``
    is stored relative to the cassette's directory and ``cassette`` is the cassette's
    path relative to ``cwd``: a replay from any checkout finds the directory again, and a
    copy of the file somewhere else is recognised as such (see :func:`launch_dir`).
    Otherwise ``cwd`` is absolute. The interpreter is stored as ``python``; arguments
    that are paths under ``cwd`` become relative to it.
    """
    cwd = cwd.resolve()
    target = cassette.resolve()
    inside = target.parent.is_relative_to(cwd)
    where = os.path.relpath(cwd, target.parent) if inside else str(cwd)
    out = []
    for i, arg in enumerate(argv):
        if i == 0 and Path(arg).name.startswith("python"):
            arg = "python"
        elif os.path.isabs(arg) and Path(arg).resolve().is_relative_to(cwd):
            arg = os.path.relpath(Path(arg).resolve(), cwd)
        out.append(arg)
    return {"argv": out, "cwd": where,
            "cassette": target.relative_to(cwd).as_posix() if inside else None}


def launch_dir(cassette: Path, header: Mapping[str, Any]) -> Path:
    """The directory to re-run a recorded command in, found from where the cassette is.

    Raises :class:`CannotLaunch` when it cannot be found: the header's absolute directory
    does not exist here, or the cassette is not where it was recorded relative to its
    project (a copy or a move), so that its relative directory would land somewhere the
    run never was.
    """
    cwd = header.get("cwd")
    where = cassette.resolve().parent
    if not isinstance(cwd, str) or not cwd:
        raise CannotLaunch(f"{cassette} does not record the directory its command ran in")
    if os.path.isabs(cwd):
        if not Path(cwd).is_dir():
            raise CannotLaunch(f"{cassette} was recorded with its command run in {cwd}, which "
                               "does not exist on this machine")
        return Path(cwd)
    recorded = header.get("cassette")
    if isinstance(recorded, str):  # the cassette's folder, relative to the run's directory
        parts = Path(recorded).parent.parts
        if parts and where.parts[-len(parts):] != parts:
            raise CannotLaunch(
                f"{cassette} was recorded as {recorded}, relative to the directory its "
                f"command ran in; this copy lies in {where}, not in a folder "
                f"{Path(*parts).as_posix()}, so that directory is unknown here")
    root = Path(os.path.normpath(where / cwd))
    if not root.is_dir():
        raise CannotLaunch(f"{cassette} was recorded with its command run in {cwd} relative "
                           f"to the cassette ({root}), which does not exist")
    return root


def startable(argv: list[str], cwd: Path) -> str | None:
    """Why ``argv`` cannot start in ``cwd`` (None: it can, as far as can be told before
    running it): a missing program, script or module."""
    import importlib.machinery
    import shutil

    if not argv:
        return "there is no command"
    program = argv[0]
    if Path(program).name.startswith("python"):
        rest = argv[1:]
        while rest and rest[0] in ("-u", "-B", "-O", "-OO", "-s", "-E", "-I", "-X"):
            rest = rest[2:] if rest[0] == "-X" else rest[1:]
        if not rest or rest[0] == "-c":
            return None
        if rest[0] == "-m":
            if len(rest) < 2:
                return "python -m names no module"
            top = rest[1].split(".")[0]
            found = importlib.machinery.PathFinder.find_spec(top, [str(cwd), *sys.path[1:]])
            if not found:
                return f"no module {rest[1]!r} is importable from {cwd}"
            if rest[1] == "pytest":  # the tests it was given (file or file::test) are here
                for arg in rest[2:]:
                    name = arg.split("::")[0]
                    if not arg.startswith("-") and (name.endswith(".py") or "::" in arg) \
                            and not (cwd / name).exists():
                        return f"the test file {name} is not in {cwd}"
            return None
        if rest[0].startswith("-"):
            return None
        script = Path(rest[0])
        script = script if script.is_absolute() else cwd / script
        if script.is_dir() or script.suffix in (".zip", ".pyz"):  # a package with __main__
            ok = (script / "__main__.py").is_file() if script.is_dir() else script.is_file()
            return None if ok else f"{rest[0]} in {cwd} has no __main__.py"
        return None if script.is_file() else f"the script {rest[0]} is not in {cwd}"
    if os.sep in program:
        path = Path(program) if os.path.isabs(program) else cwd / program
        return None if path.is_file() else f"the program {program} is not in {cwd}"
    return None if shutil.which(program) else f"no program {program!r} on PATH"


LAUNCH_VERSION = 1


class LaunchMode(enum.StrEnum):
    """What the launched program's session does (``recorder.mode()``, ``DEJA_MODE``)."""

    RECORD = "record"
    REPLAY = "replay"
    FORK = "fork"
    RESUME = "resume"


@dataclass(frozen=True)
class LaunchSpec:
    """What a launcher tells the program it starts: its session, and its own part in it.

    ``cassette`` is the file the mode works on: the run's file (``record``, ``resume``),
    the cassette served (``replay``), or a fork's parent. ``report`` is where the program
    hands over its end line (or a replay its result); without one it closes its run
    itself. The launcher adds its own pid (a program whose launcher is gone closes its run
    itself), the writer lock's inherited file descriptor and the cassette it locks, and
    whether the program starts with the stop signals blocked (``signals_held``).
    """

    mode: LaunchMode
    cassette: str
    report: str | None = None
    # record (run_id and allow_torn also for a fork)
    run_id: str | None = None
    argv: tuple[str, ...] | None = None
    fsync: str | None = None
    labels: dict[str, Any] = field(default_factory=dict)
    redact_headers: tuple[str, ...] = ()
    redact_body: tuple[str, ...] = ()
    redact_patterns: tuple[str, ...] = ()
    redact_query: tuple[str, ...] = ()
    overwrite: bool = False
    budgets: dict[str, Any] | None = None
    loop_guard: bool = True
    breaker: bool = True
    # replay
    allow_torn: bool = False
    allow_incomplete: bool = False
    require_signature: bool = False
    allow_unverified: bool = False
    ignore: tuple[str, ...] = ()  # the replay policy (replayer.policy.ReplayPolicy.parse)
    normalise: tuple[str, ...] = ()
    # fork: the step, its edit (a JSON patch), the new file, a cassette to serve after it
    at: int | None = None
    patch: tuple[Any, ...] | None = None
    out: str | None = None
    then_replay: str | None = None
    # fork: its tool policy, NAME=RULE (replayer.tool_policy.ToolPolicy.parse); a fork at
    # the step the program leaves the cassette (replay, then live: replayer.then_live),
    # matched under ignore and normalise
    tools: tuple[str, ...] = ()
    then_live: bool = False
    # resume: the tools sent or run again when the run stopped inside one and nothing can
    # settle it (replayer.continuation.ContinuationSession's resend)
    resend: tuple[str, ...] = ()
    # the launcher's own
    launcher_pid: int | None = None
    lock_fd: int | None = None
    lock_cassette: str | None = None
    signals_held: bool = False

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: the values given are normalised once, here
        set_(self, "mode", LaunchMode(self.mode))
        for name in ("argv", "redact_headers", "redact_body", "redact_patterns",
                     "redact_query", "patch", "ignore", "normalise", "tools", "resend"):
            value = getattr(self, name)
            if isinstance(value, list):
                set_(self, name, tuple(value))

    def encode(self) -> str:
        """The spec as the one value of ``DEJA_LAUNCH``: JSON, its version first."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return json.dumps({"version": LAUNCH_VERSION, **fields}, separators=(",", ":"))

    @classmethod
    def decode(cls, text: str) -> LaunchSpec:
        """Read a spec :meth:`encode` wrote; :class:`ConfigError` for anything else (not
        JSON, another version, a missing or unknown field, a field of the wrong type)."""
        where = "the launch spec"
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"{where} is not JSON ({exc}): start the program with deja "
                              "record, replay, fork or resume") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{where} is not a JSON object")
        version = data.pop("version", None)
        if version != LAUNCH_VERSION:
            raise ConfigError(f"{where} is version {version!r}, and this deja reads version "
                              f"{LAUNCH_VERSION}: the program was started by another deja; "
                              "start it with this deja's own command")
        hints = typing.get_type_hints(cls)
        unknown = sorted(set(data) - set(hints))
        if unknown:
            raise ConfigError(f"{where} has fields this deja does not know: "
                              f"{', '.join(unknown)}")
        for name in ("mode", "cassette"):
            if name not in data:
                raise ConfigError(f"{where} has no {name}")
        for name, value in data.items():
            if not _fits(value, hints[name]):
                raise ConfigError(f"{where}: {name} is {value!r}, not {_shown(hints[name])}")
        return cls(**data)


def _fits(value: Any, hint: Any) -> bool:
    """Does a JSON value fit a field's type (a tuple arrives as a list)?"""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        return any(_fits(value, arg) for arg in args)
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if origin is tuple:
        return isinstance(value, list) and all(_fits(item, args[0]) for item in value)
    if origin is dict:
        return isinstance(value, dict) and all(isinstance(k, str) for k in value)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return value in {member.value for member in hint}
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _shown(hint: Any) -> str:
    """A field's type as a message names it (a mode lists the valid values)."""
    args = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    inner = args[0] if len(args) == 1 else hint
    if isinstance(inner, type) and issubclass(inner, enum.Enum):
        return "one of " + ", ".join(member.value for member in inner)
    origin = typing.get_origin(inner)
    name = {tuple: "a list", dict: "an object"}.get(origin) if origin else \
        {str: "a string", int: "an integer", bool: "true or false"}.get(inner)
    return (name or str(inner)) + (" or null" if type(None) in typing.get_args(hint) else "")


def write_end(path: str | Path, end: dict[str, Any], exit_code: int,
              keyring: Keyring | None = None, *,
              handed: str | None = None) -> dict[str, Any]:
    """Close a cassette a program left open, with the end line it handed over and its exit
    status (``deja record`` does this once the program has exited). ``handed`` is the
    status the program handed over (and wrote in its status record), when the launcher
    has changed it: the record then says the status written."""
    from recorder.cassette import load

    ring = keyring or load_keyring(create=False)
    loaded = load(path, keyring=ring, require_signature=True, allow_incomplete=True)
    handed = handed or end.get("status")
    end = dict(end, exit_code=exit_code)
    if exit_code != 0 and end.get("status") == EndStatus.COMPLETED:
        end["status"] = EndStatus.ERROR
        end.setdefault("reason", f"exit status {exit_code}")
    key = ring.get(str(loaded.header.get("key_id")))
    assert key is not None  # load() verified with it
    written = CassetteWriter.reopen(loaded, key, Fsync.SYNC).close(end)
    if written.get("status") != handed:  # the record said what the program handed over
        from recorder.harness.progress import close_record

        close_record(str(loaded.header.get("run")), run_status(written),
                     str(written.get("reason") or ""))
    return written
