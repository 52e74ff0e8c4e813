"""Fork a run at a step with an edited observation, and resume a crashed run.

Fork::

    with replayer.fork("cassettes/r_1.jsonl", at=5,
                       patch=[{"op": "replace", "path": "/result", "value": '{"results": []}'}]
                       ) as run:
        agent()                      # steps 0-4 replayed, step 5 edited, then live

Steps before ``at`` replay from the parent (its signature must verify); at ``at`` the
agent receives the edited observation; after it, calls go live (or to ``then_replay``).
The new cassette starts with a copy of the parent's steps before ``at``, then the edited
step (``"edited": true``), a ``fork_edit`` control line holding the patch, then the live
steps. Its header names the parent (``run``, ``step``) and ``prefix_sig``, the parent's
signature just before the fork step, which pins the exact prefix forked from. The parent
file is never written.

Resume::

    with replayer.resume("cassettes/r_2.jsonl"):
        agent()                      # everything recorded replays, then the run goes on

Everything recorded replays (no live call, no side effect repeated); a torn last line is
cut first and reported; an intent without an outcome is settled; then the run continues
live, appending to the same cassette after a ``resumed`` control line.

Every input is checked before anything is written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from recorder.capture import session as _session
from recorder.cassette import RESUMABLE_ENDS, Cassette, CassetteWriter, load
from recorder.cassette.keys import Keyring, load_keyring
from recorder.errors import ConfigError, Divergence, KeyMissing
from recorder.record import launch_dir, new_run_id, portable_launch
from replayer import edit as _edit
from replayer.continuation import ContinuationSession

log = logging.getLogger("deja.replayer")


@dataclasses.dataclass(frozen=True)
class ForkPlan:
    """A checked fork, ready to run: nothing has been written yet."""

    parent: Cassette
    at: int
    original: dict[str, Any]
    edited: dict[str, Any]
    patch: list[dict[str, Any]]
    out: Path
    run_id: str


def _key_for(cassette: Cassette, keyring: Keyring) -> bytes:
    key = keyring.get(str(cassette.header.get("key_id")))
    if key is None:
        raise KeyMissing(f"{cassette.path} is signed with key {cassette.header.get('key_id')}, "
                         "which is not available (DEJA_KEY, the key file or DEJA_OLD_KEYS)")
    return key


def plan_fork(cassette: str | Path, at: int, *, patch: list[dict[str, Any]] | None = None,
              replace: Any = None, sets: list[str] | tuple[str, ...] = (),
              out: str | Path | None = None, keyring: Keyring | None = None,
              run_id: str | None = None, allow_torn: bool = False) -> ForkPlan:
    """Check a fork (parent signature, step, edit) and work out the edited step.
    ``allow_torn``: a parent whose last line is torn forks from its intact lines."""
    ring = keyring or load_keyring(create=False)
    parent = load(cassette, keyring=ring, require_signature=True, allow_incomplete=True,
                  allow_torn=allow_torn)
    n = len(parent.observations)
    if not 0 <= at < n:
        raise ConfigError(f"{parent.path}: fork step {at} is out of range; the run has steps "
                          f"0-{n - 1} (see `deja show {parent.path}`)")
    given = sum(x is not None for x in (patch, replace, tuple(sets) or None))
    if given != 1:
        raise ConfigError("give exactly one edit: a JSON patch, a replacement document, or "
                          "--set PATH=VALUE pairs")
    original = parent.observations[at]
    if "within" in original:
        raise ConfigError(f"step {at} happened inside tool call {original['within']}; fork at "
                          "the tool's own step instead")
    doc = _edit.view(original)
    ops = _edit.set_patch(sets, doc) if sets else patch
    edited_doc, applied = _edit.apply(doc, patch=ops, replace=replace, step=at)
    edited = _edit.rebuild(original, edited_doc)
    run_id = run_id or new_run_id()
    target = Path(out) if out is not None else parent.path.parent / f"{run_id}.jsonl"
    if target.suffix != ".jsonl" and (target.is_dir() or target.suffix == ""):
        target = target / f"{run_id}.jsonl"
    if target.exists():
        raise ConfigError(f"{target} already exists; choose another -o")
    if target.resolve() == parent.path.resolve():
        raise ConfigError("a fork never writes its parent; choose another -o")
    return ForkPlan(parent, at, original, edited, applied, target, run_id)


class _Continue(contextlib.ContextDecorator):
    """Runs a ContinuationSession around a block (fork or resume)."""

    def __init__(self, make: Any, *, abandon_on_divergence: bool) -> None:
        self._make = make
        self._abandon = abandon_on_divergence
        self.session: ContinuationSession | None = None

    def __enter__(self) -> ContinuationSession:
        if _session.active() is not None:
            raise ConfigError("another deja session is active in this process")
        self.session = self._make()
        return self.session.start()

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        assert self.session is not None
        if isinstance(exc, Divergence) and self._abandon:
            # The agent no longer matches its own log: leave the cassette as it was, with no
            # end line, so that it can still be resumed by a fixed agent.
            self.session.abandon()
            return
        self.session.close(error=exc)


def fork(cassette: str | Path, at: int, *, patch: list[dict[str, Any]] | None = None,
         replace: Any = None, sets: list[str] | tuple[str, ...] = (),
         out: str | Path | None = None, then_replay: str | Path | None = None,
         keyring: Keyring | None = None, fsync: str = "turn",
         allow_torn: bool = False) -> _Continue:
    """Fork ``cassette`` at step ``at`` with an edit; see the module docstring."""
    ring = keyring or load_keyring(create=False)
    plan = plan_fork(cassette, at, patch=patch, replace=replace, sets=sets, out=out,
                     keyring=ring, allow_torn=allow_torn)
    # Its steps are re-signed into the fork: it must verify like the parent.
    other = (load(then_replay, keyring=ring, require_signature=True, allow_incomplete=True)
             if then_replay else None)
    return _Continue(lambda: start_fork(plan, then_replay=other, keyring=ring, fsync=fsync),
                     abandon_on_divergence=False)


def start_fork(plan: ForkPlan, *, then_replay: Cassette | None = None,
               keyring: Keyring | None = None, fsync: str = "turn",
               ran_in: Path | None = None) -> ContinuationSession:
    """Write the fork's prefix and return its (not yet started) session. ``ran_in``: the
    directory the fork's command runs in (default: the parent's, else this one)."""
    ring = keyring or load_keyring()
    parent, at = plan.parent, plan.at
    signing = ring.signing or _key_for(parent, ring)
    header = {k: v for k, v in parent.header.items() if k not in ("format", "key_id")}
    header.update(run=plan.run_id, created=datetime.now(UTC).isoformat(
        timespec="milliseconds").replace("+00:00", "Z"), parent={"run": parent.run, "step": at,
                                           "prefix_sig": parent.sigs[at],
                                           "path": str(parent.path)})
    if ran_in is None:
        try:  # the fork re-runs the parent's command: from the parent's directory
            ran_in = launch_dir(parent.path, parent.header)
        except ConfigError:  # a copied parent: where this runs
            ran_in = Path.cwd()
    launch = portable_launch([], ran_in, plan.out)
    header.update(cwd=launch["cwd"], cassette=launch["cassette"])
    writer = CassetteWriter(plan.out, header, signing, fsync)
    for obs in parent.observations[:at]:
        writer.append_copy(obs, parent.requests.get(obs["seq"]))
    writer.append_copy(plan.edited, parent.requests.get(at))
    writer.append({"kind": "control", "event": "fork_edit",
                   "detail": {"parent": parent.run, "step": at, "patch": plan.patch}},
                  sync=True)
    prefix = dataclasses.replace(parent, observations=(*parent.observations[:at], plan.edited),
                                 end=None)
    return ContinuationSession(prefix, writer, then_replay=then_replay, fsync=fsync,
                               keyring=ring)


def plan_resume(cassette: str | Path, *, keyring: Keyring | None = None) -> Cassette:
    """Check that ``cassette`` can be resumed: it verifies and has no end line."""
    ring = keyring or load_keyring(create=False)
    loaded = load(cassette, keyring=ring, require_signature=True, allow_torn=True,
                  allow_incomplete=True)
    if loaded.end is not None and loaded.end.get("status") not in RESUMABLE_ENDS:
        raise ConfigError(f"{loaded.path}: the run already ended with status "
                          f"{loaded.end.get('status')!r}; there is nothing to resume (only a "
                          "crashed or interrupted run can be resumed)")
    _key_for(loaded, ring)
    return loaded


def resume(cassette: str | Path, *, keyring: Keyring | None = None,
           fsync: str = "turn") -> _Continue:
    """Resume a crashed run; see the module docstring."""
    ring = keyring or load_keyring(create=False)
    loaded = plan_resume(cassette, keyring=ring)
    return _Continue(lambda: start_resume(loaded, keyring=ring, fsync=fsync),
                     abandon_on_divergence=True)


def start_resume(loaded: Cassette, *, keyring: Keyring | None = None,
                 fsync: str = "turn") -> ContinuationSession:
    ring = keyring or load_keyring(create=False)
    torn = loaded.torn_offset
    if torn is not None:
        log.warning("%s: cutting the torn last line at byte %d before resuming",
                    loaded.path, torn)
    writer = CassetteWriter.reopen(loaded, _key_for(loaded, ring), fsync)
    served = len(loaded.observations)
    detail: dict[str, Any] = {"replayed": served, "torn_cut_at": torn}
    if loaded.end is not None:  # an interrupted run: its end line was cut, kept here
        detail["after_end"] = {k: v for k, v in loaded.end.items() if k != "seq"}

    def on_live(session: ContinuationSession) -> None:
        session._append({"kind": "control", "event": "resumed", "detail": detail}, sync=True)

    return ContinuationSession(loaded, writer, on_live=on_live, fsync=fsync, keyring=ring)
