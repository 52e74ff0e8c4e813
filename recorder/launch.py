"""A run's launch: what a cassette's header says of how its run was started, and what a
launcher (``deja record``, ``replay``, ``fork``, ``resume``) does with it.

A new run's id; the software it ran with; its command and directory, stored so that a
checkout elsewhere can run it again (:func:`portable_launch`), and found again from where
the cassette lies (:func:`launch_dir`); whether that command can start at all
(:func:`startable`); and the end line a launcher writes for a program that has exited
(:func:`write_end`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import os
import platform
import secrets
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from recorder.cassette import CassetteWriter, Fsync
from recorder.cassette.keys import Keyring, load_keyring
from recorder.cassette.schema import EndStatus, run_status
from recorder.errors import CannotLaunch

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
