"""Nondeterministic values as observations: clock, uuid, random, and your own.

Each function returns a live value while recording (and logs it) and the recorded value
while replaying; with no session active it just returns a live value. Use them wherever
the agent's behaviour depends on the value, so that a replay takes the same path::

    started = recorder.now()
    request_id = recorder.uuid4()
    temperature = recorder.value("temperature", lambda: read_sensor())

Each effect line also names its call site, the first frame outside deja's own packages,
as ``"site": "agent.py:Planner.plan:14"``: file, function qualname and line in one string,
cheap to write, and split from the right (neither a qualname nor a line holds a colon).
A replay serves the next unused value of that name recorded at the same file and
function, so an agent whose effects are now asked for in another order still gets each
call site's own values (:func:`call_site` says why the line takes no part). The file is
the path Python imported it by (relative to its ``sys.path`` entry), never a path of
this machine.
"""

from __future__ import annotations

import os
import random as _random
import sys
import time
import uuid as _uuid
from collections.abc import Callable
from datetime import UTC, datetime
from types import FrameType
from typing import Any, NamedTuple

from recorder.capture import session

# Frames of these packages are deja's own; the call site is the first frame outside them.
_OWN = frozenset({"deja", "recorder", "replayer", "viewer"})
# co_filename -> the portable path stored for it, worked out once per file.
_files: dict[str, str] = {}


class Site(NamedTuple):
    """Where an effect was asked for: a portable file path, function qualname, line."""

    file: str
    function: str
    line: int

    def record(self) -> str:
        """The form stored on an effect line: ``file:function:line``."""
        return f"{self.file}:{self.function}:{self.line}"

    @classmethod
    def parse(cls, text: Any) -> Site | None:
        """The site an effect line stored (None for a line without a readable one)."""
        if not isinstance(text, str):
            return None
        file, _, rest = text.rpartition(":")
        file, _, function = file.rpartition(":")
        if not (file and function and rest.isdigit()):
            return None
        return cls(file, function, int(rest))

    def __str__(self) -> str:
        return f"{self.file}:{self.function}"


def _portable(filename: str) -> str:
    """``filename`` as imported: relative to the deepest ``sys.path`` entry holding it, else
    to the working directory, else its bare name (``<string>`` and the like stay as they
    are). Never an absolute path."""
    if filename.startswith("<"):
        return filename
    path = os.path.abspath(filename)
    roots = [os.path.abspath(entry or os.curdir) for entry in sys.path
             if isinstance(entry, str)] + [os.getcwd()]
    inside = [root for root in roots if path.startswith(root.rstrip(os.sep) + os.sep)]
    if not inside:
        return os.path.basename(path)
    return os.path.relpath(path, max(inside, key=len)).replace(os.sep, "/")


def call_site() -> Site | None:
    """The call site of the effect being asked for: the first frame outside deja.

    On the recording hot path, so it only walks frames and reads the code object; a
    file's portable path is computed once. Matching uses ``file`` and ``function`` only.
    The line is stored for people (notes, diffs) but does not take part: a line number
    changes whenever code above it is edited (an import, a comment), and matching on it
    would make every effect of the file look moved after any such edit, burying a real
    reordering in notes. Worse, preferring an exact line inside a function can hand a
    function's values out of their order once the lines have shifted. Within one function,
    values are served in recorded order.
    """
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__") or ""
        if module.partition(".")[0] not in _OWN:
            code = frame.f_code
            file = _files.get(code.co_filename)
            if file is None:
                file = _files[code.co_filename] = _portable(code.co_filename)
            return Site(file, code.co_qualname, frame.f_lineno)
        frame = frame.f_back
    return None


def value(name: str, produce: Callable[[], Any] | Any) -> Any:
    """A custom value: ``produce()`` (or ``produce`` itself) live, the recorded one on replay."""
    make = produce if callable(produce) else (lambda: produce)
    current = session.active()
    if current is None:
        return make()
    return current.effect(name, make)


def now() -> float:
    """``time.time()``."""
    return float(value("time", time.time))


def utcnow() -> datetime:
    """The current time as an aware UTC datetime."""
    return datetime.fromtimestamp(now(), UTC)


def uuid4() -> _uuid.UUID:
    """A random UUID."""
    return _uuid.UUID(value("uuid", lambda: str(_uuid.uuid4())))


def random() -> float:
    """``random.random()``."""
    return float(value("random", _random.random))


def randint(a: int, b: int) -> int:
    """``random.randint(a, b)``."""
    return int(value("randint", lambda: _random.randint(a, b)))
