"""Replay, then live: a fork whose fork point is found, not given.

After a code or prompt change, the question is what the agent does *now* on the incident,
without paying for the part of it that did not change. ::

    with replayer.replay("incidents/r_7.jsonl", on_divergence="live",
                         out="fixed/r_7-fix.jsonl"):
        fixed_agent()        # served from the recording while it asks what it asked
                             # before; live from the first call the recording does not hold

The recording is served *as if live* (copied into the new run, seen by the guards) while
the program asks what it asked before. At the first call it does not hold, the recording
closes and the run goes on live: model calls go to the program's base URL (the real
provider, or a stub), and tool calls are decided by the tool policy
(:mod:`replayer.tool_policy`: a side effect is never run live unless named).

The new cassette's header names its parent and the step the run left it at
(``parent.step``: the steps before it were served from the parent, the step itself is the
first live one; ``parent.divergence`` says how: the kind of change, why, and the recorded
call nearest to the one made instead). The file is
written from that moment on, the copied lines first: until the run leaves the recording
nothing new has happened. A run that never leaves it is written whole at its end, with
no ``parent.step``; one stopped before it leaves, with what was served so far (one killed
outright leaves nothing: every line it had is in the parent).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

from recorder.capture.session import Scope
from recorder.cassette import Cassette, CassetteWriter, load
from recorder.cassette.format import FEATURES
from recorder.cassette.keys import Keyring, load_keyring
from recorder.cassette.schema import run_file, utc_stamp
from recorder.errors import CassetteWriteError, PathTaken
from recorder.launch import new_run_id, portable_launch
from replayer import continuation
from replayer.continuation import ContinuationSession
from replayer.policy import ReplayPolicy
from replayer.replay import ReplaySession
from replayer.tool_policy import ToolPolicy

__all__ = ["ThenLive", "plan_then_live", "start_then_live", "then_live"]


@dataclasses.dataclass(frozen=True)
class ThenLive:
    """A checked replay-then-live, ready to run: nothing has been written yet."""

    parent: Cassette
    out: Path
    run_id: str


def plan_then_live(cassette: str | Path, *, out: str | Path | None = None,
                   keyring: Keyring | None = None, run_id: str | None = None,
                   allow_incomplete: bool = False) -> ThenLive:
    """Check the parent (its signature must verify: its answers are served as if live and
    signed into the new run) and where the new run goes (never over a file)."""
    parent = load(cassette, keyring=keyring or load_keyring(create=False),
                  require_signature=True, allow_incomplete=allow_incomplete)
    run_id = run_id or new_run_id()
    target = run_file(out if out is not None else parent.path.parent, run_id)
    if target.exists():
        raise PathTaken(f"{target} already exists; choose another -o")
    if target.resolve() == parent.path.resolve():
        raise PathTaken("a replay-then-live never writes its parent; choose another -o")
    return ThenLive(parent, target, run_id)


class _WrittenOnLeaving:
    """A cassette writer that holds its lines until the run leaves the recording, then
    creates the file with the fork point in its header and writes them; the rest passes
    straight through (the interface :class:`recorder.record.RecordSession` uses)."""

    def __init__(self, path: Path, header: dict[str, Any], key: bytes, fsync: str) -> None:
        if path.exists():
            raise PathTaken(f"{path} already exists; choose another -o")
        self.path, self.header = path, header
        self._key, self._fsync = key, fsync
        self._held: list[tuple[dict[str, Any], dict[str, Any]]] = []
        self._writer: CassetteWriter | None = None

    @property
    def failed(self) -> CassetteWriteError | None:
        return self._writer.failed if self._writer is not None else None

    @property
    def next_seq(self) -> int:
        return self._writer.next_seq if self._writer is not None else len(self._held)

    @property
    def features(self) -> frozenset[str]:
        """The optional storage forms the new file uses: a new file's, all of them (lines
        held before it exists are stored as it will read them)."""
        return self._writer.features if self._writer is not None else frozenset(FEATURES)

    def open(self, step: int | None, divergence: dict[str, Any] | None) -> None:
        """Create the file, naming the parent's ``step`` the run left, and write the
        lines held so far (once)."""
        if self._writer is not None:
            return
        self.header["parent"] = {**self.header["parent"],
                                 **({"step": step} if step is not None else {}),
                                 **({"divergence": divergence} if divergence else {})}
        self._writer = CassetteWriter(self.path, self.header, self._key, self._fsync)
        self.header = dict(self._writer.header)
        held, self._held = self._held, []
        for obs, options in held:
            self._writer.append(obs, **options)

    def append(self, obs: dict[str, Any], **options: Any) -> dict[str, Any]:
        if self._writer is not None:
            return self._writer.append(obs, **options)
        self._held.append((obs, options))
        return {"seq": len(self._held) - 1, **obs}

    def close(self, end: dict[str, Any]) -> dict[str, Any]:
        self.open(None, None)  # never left the recording: the whole run, copied
        assert self._writer is not None
        return self._writer.close(end)

    def discard(self) -> None:
        """The session never started: no file, or the one begun removed."""
        if self._writer is not None:
            self._writer.discard()

    def abandon(self) -> None:
        """Stop without an end line (the launcher writes it): the file exists first."""
        self.open(None, None)
        assert self._writer is not None
        self._writer.abandon()


def start_then_live(plan: ThenLive, *, policy: ReplayPolicy | None = None,
                    tools: ToolPolicy | None = None, keyring: Keyring | None = None,
                    fsync: str = "turn", ran_in: Path | None = None) -> ContinuationSession:
    """The (not yet started) session of a replay-then-live; see the module docstring.
    ``policy``: what may differ from the recording without leaving it (added to the
    project's and the providers' declared volatility)."""
    ring = keyring or load_keyring()
    parent = plan.parent
    tools = tools if tools is not None else ToolPolicy()
    header = {k: v for k, v in parent.header.items() if k not in ("format", "key_id")}
    header.update(run=plan.run_id, created=utc_stamp(), tools=tools.to_header(),
                  parent={"run": parent.run, "path": str(parent.path), "mode": "then_live"})
    launch = portable_launch([], ran_in or Path.cwd(), plan.out)
    header.update(cwd=launch["cwd"], cassette=launch["cassette"])
    signing = ring.signing or continuation.signing_key(parent, ring)
    writer = _WrittenOnLeaving(plan.out, header, signing, fsync)
    log = ReplaySession(parent, on_miss="pass", copies=True,
                        policy=ReplayPolicy.configured(policy))
    empty = dataclasses.replace(parent, observations=(), end=None)

    def left(session: ContinuationSession) -> None:
        info = log.divergence
        if info is None:
            writer.open(None, None)
            return
        # The run leaves at the step it makes next: every step before it was served from
        # the recording, in the recording's order (the recorded call nearest to the one
        # it made instead is the divergence's ``nearest``; past the recording's last step,
        # none).
        writer.open(writer.next_seq, {
            "kind": info.kind, "category": info.category, "reason": info.reason,
            **({"nearest": info.step} if info.step is not None else {})})

    try:
        return ContinuationSession(empty, cast(CassetteWriter, writer), sources=[log],
                                   mode="fork", on_leave=left, fsync=fsync, keyring=ring,
                                   tool_policy=tools, recorded_runs=(parent,),
                                   under_way_in=parent)
    except BaseException:  # settings refused ([tool.deja]): no file left behind
        writer.discard()
        raise


def then_live(cassette: str | Path, *, out: str | Path | None = None,
              policy: ReplayPolicy | None = None, tools: ToolPolicy | None = None,
              live_tools: Sequence[str] = (), keyring: Keyring | None = None,
              fsync: str = "turn") -> Scope[ContinuationSession]:
    """Replay ``cassette`` around a block until the program asks for something it does not
    hold, then go live into ``out``; see the module docstring. ``tools`` and
    ``live_tools``: the tool policy of the live part (a side effect never live unless
    named)."""
    ring = keyring or load_keyring(create=False)
    plan = plan_then_live(cassette, out=out, keyring=ring)
    chosen = ToolPolicy({**(tools.rules if tools else {}),
                         **ToolPolicy.parse(live=live_tools).rules})
    return continuation.scope(
        lambda: start_then_live(plan, policy=policy, tools=chosen, keyring=ring, fsync=fsync),
        abandon_on_divergence=False, name=f"replay-then-live({cassette})")
