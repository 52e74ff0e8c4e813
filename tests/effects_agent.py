"""A small agent whose effects come from two call sites (run by `deja record` / `deja replay`
in tests/recorder/test_effects.py, and imported there; not collected).

``plan`` and ``act`` each ask for a ``recorder.uuid4()``; the output prints which call got
which value. Environment:

- ``EFFECTS_ORDER``: ``plan-first`` (default) or ``act-first``: the same two calls, swapped;
- ``EFFECTS_MOVED=1``: the planning uuid is asked for in ``draft`` instead of ``plan``, a
  call site the recording never saw;
- ``EFFECTS_REFUSE=1``: also asks for a value no cassette can hold, and catches the refusal.
"""

from __future__ import annotations

import os

import recorder


def plan() -> str:
    return f"plan {recorder.uuid4()}"


def draft() -> str:
    return f"plan {recorder.uuid4()}"


def act() -> str:
    return f"act {recorder.uuid4()}"


def refused() -> str:
    try:
        recorder.value("handle", object)  # a class: no cassette holds it
    except recorder.UnserializableValue as exc:
        return f"refused {type(exc).__name__}: {exc}"
    return "not refused"


def main() -> int:
    first = draft if os.environ.get("EFFECTS_MOVED") == "1" else plan
    calls = [act, first] if os.environ.get("EFFECTS_ORDER") == "act-first" else [first, act]
    if os.environ.get("EFFECTS_REFUSE") == "1":
        calls.insert(1, refused)
    for call in calls:
        print(call())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
