"""Fork a run at a step with an edited observation.

Fork::

    with replayer.fork("cassettes/r_1.jsonl", at=5,
                       patch=[{"op": "replace", "path": "/result", "value": '{"results": []}'}]
                       ) as run:
        agent()                      # steps 0-4 replayed, step 5 edited, then live

Steps before ``at`` replay from the parent (its signature must verify); at ``at`` the
agent receives the edited observation; after it, calls go live (or to ``then_replay``).
The new cassette starts with a copy of the parent's steps before ``at``, then the edited
step (``"edited": true``), a ``fork_edit`` control line holding the patch, then the live
steps (``fork_edit`` also keeps the step's original document). Its header names the
parent (``run``, ``step``) and ``prefix_sig``, the parent's
signature just before the fork step, which pins the exact prefix forked from. The parent
file is never written.

Every input is checked before anything is written.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

from recorder.canonical import canonical
from recorder.capture.session import Scope
from recorder.cassette import Cassette, CassetteWriter, load
from recorder.cassette.format import LINE_DEPTH, text_nests_deeper
from recorder.cassette.keys import Keyring, load_keyring
from recorder.cassette.schema import Control, Kind, Observation, run_file, utc_stamp
from recorder.errors import CannotLaunch, EditError, NoSuchStep, PathTaken, UnserializableValue
from recorder.launch import launch_dir, new_run_id, portable_launch
from replayer import continuation
from replayer import edit as _edit
from replayer.continuation import ContinuationSession
from replayer.tool_policy import Rule, ToolPolicy
from replayer.under_way import CallTree, call_lines, is_side_effect, mcp_in_flight


@dataclasses.dataclass(frozen=True)
class ForkPlan:
    """A checked fork, ready to run: nothing has been written yet."""

    parent: Cassette
    at: int
    original: Observation
    edited: Observation  # the original line with its edit applied
    patch: list[dict[str, Any]]
    out: Path
    run_id: str

    def side_effect_warning(self, tools: ToolPolicy | None = None) -> str | None:
        """What to say before running the fork (:func:`side_effect_warning`)."""
        return side_effect_warning(self.parent, self.at, tools)


def side_effects_after(parent: Cassette, at: int) -> list[tuple[int, str]]:
    """(seq, name) of each side-effecting tool call (``side_effect=True``: its intent
    line; an MCP tool annotated destructive) the recorded run made after step ``at``:
    what the tool policy of a fork at ``at`` keeps from running live unless named."""
    return [(o["seq"], str(o.get("name") or "?")) for o in parent.observations
            if o["seq"] > at and is_side_effect(o)]


def _side_effect(obs: Mapping[str, Any]) -> bool:
    """A side-effecting tool call: an intent (``side_effect=True``), or an MCP tool the
    server annotated destructive."""
    if obs.get("kind") == Kind.INTENT:
        return True
    mcp = obs.get("mcp")
    return obs.get("kind") == Kind.TOOL and isinstance(mcp, Mapping) and \
        mcp.get("destructive") is True


def side_effect_warning(parent: Cassette, at: int,
                        tools: ToolPolicy | None = None) -> str | None:
    """What to say before a fork at ``at`` runs about those calls (None: there are none):
    which of them the fork's tool policy lets run live, and what the others get."""
    found = side_effects_after(parent, at)
    if not found:
        return None
    policy = tools if tools is not None else ToolPolicy()
    named = ", ".join(f"{name} (step {seq})" for seq, name in found[:8])
    more = f" and {len(found) - 8} more" if len(found) > 8 else ""
    live = sorted({name for _, name in found
                   if policy.rule_for(name, side_effect=True).rule is Rule.LIVE})
    said = (f"after step {at} the recorded run called {len(found)} side-effecting "
            f"tool(s): {named}{more}. ")
    if live:
        return said + (f"This fork runs {', '.join(live)} live, for real (named with "
                       "--live-tool); any other is served its recorded answer or refused")
    return said + ("In this fork they do not run: each call is served the recorded answer "
                   "to the same arguments, or refused (the agent sees ToolRefused); "
                   "--live-tool NAME runs one for real")


def plan_fork(cassette: str | Path, at: int, *, patch: list[dict[str, Any]] | None = None,
              replace: Any = None, sets: list[str] | tuple[str, ...] = (),
              out: str | Path | None = None, keyring: Keyring | None = None,
              run_id: str | None = None, allow_torn: bool = False) -> ForkPlan:
    """Check a fork (parent signature, step, edit) and work out the edited step.
    ``allow_torn``: a parent whose last line is torn forks from its intact lines."""
    ring = keyring or load_keyring(create=False)
    parent = load(cassette, keyring=ring, require_signature=True, allow_incomplete=True,
                  allow_torn=allow_torn)
    original = _step(parent, at)
    if sum(x is not None for x in (patch, replace, tuple(sets) or None)) != 1:
        raise EditError("give exactly one edit: a JSON patch, a replacement document, or "
                        "--set PATH=VALUE pairs")
    if "within" in original:
        raise EditError(f"step {at} happened inside tool call {original['within']}; fork at "
                        "the tool's own step instead")
    _outside_side_effects(parent, at)
    doc = _edit.view(original)
    ops = _edit.set_patch(sets, doc) if sets else patch
    edited_doc, applied = _edit.apply(doc, patch=ops, replace=replace, step=at)
    run_id = run_id or new_run_id()
    # a copy of ``original`` with its result side replaced: a line of the same kind
    edited = cast(Observation, _edit.rebuild(original, edited_doc))
    _fits_a_line(at, {"patch": applied, "original": doc}, edited)
    return ForkPlan(parent, at, original, edited, applied, _fork_path(parent, out, run_id),
                    run_id)


def _outside_side_effects(parent: Cassette, at: int) -> None:
    """Refuse a fork at a step recorded while a side effect was under way (a tool that ran
    beside it, or one the program gave up on): the fork's prefix would hold its intent
    and not its outcome, and a fork neither runs such a call again nor guesses whether it
    took effect."""
    outcomes = {o.get("intent"): o["seq"] for o in parent.observations
                if o["kind"] == Kind.OUTCOME}
    for obs in parent.observations:
        if obs["seq"] >= at:
            break
        if obs["kind"] != Kind.INTENT:
            continue
        done = outcomes.get(obs["seq"])
        if done is None or done > at:
            where = (f"its outcome at step {done}" if done is not None
                     else "no outcome: the run ended inside it or the program gave it up")
            raise EditError(
                f"step {at} was recorded while side-effecting tool {obs.get('name')!r} was "
                f"under way (its intent at step {obs['seq']}, {where}); a fork there would "
                f"hold its intent and not its outcome. Fork at a step before {obs['seq']}"
                + (f" or after {done}" if done is not None else ""))
    _outside_calls_with_side_effects(parent, at)
    _outside_mcp_in_flight(parent, at)


def _outside_mcp_in_flight(parent: Cassette, at: int) -> None:
    """Refuse a fork at a step recorded while a destructive MCP tool call was in flight
    (its ``sending`` line before the step, its tool line after it or never): the fork's
    prefix would hold the one and not the other."""
    lines = call_lines(parent.observations)[0]
    for fp, seqs in mcp_in_flight([o for o in lines if o["seq"] < at]).items():
        answered = next((o["seq"] for o in lines
                         if o["seq"] >= at and o["kind"] == Kind.TOOL and o.get("fp") == fp),
                        None)
        detail = parent.observations[seqs[0]].get("detail")
        tool = detail.get("tool") if isinstance(detail, Mapping) else None
        where = f"answered at step {answered}" if answered is not None else \
            "never answered: the run ended before it was"
        raise EditError(
            f"step {at} was recorded while a call of destructive MCP tool {tool!r} was in "
            f"flight (sent at step {seqs[0]}, {where}); a fork there would hold the call and "
            f"not its answer. Fork at a step before {seqs[0]}"
            + (f" or after {answered}" if answered is not None else ""))


def _outside_calls_with_side_effects(parent: Cassette, at: int) -> None:
    """Refuse a fork at a step recorded while a tool call was under way whose body (or a
    call inside it) had made a side effect before the step (its lines name their calls,
    ``tool_calls``): the fork would run that body live, and the side effect again."""
    if "tool_calls" not in (parent.header.get("features") or ()):
        return
    lines = call_lines(parent.observations)[0]
    tree = CallTree(lines)
    for obs in lines:
        if obs["seq"] >= at:
            break
        call = tree.root(obs.get("within")) if is_side_effect(obs) else None
        while call is not None:  # the calls the side effect was made inside
            done = tree.closed.get(call)
            if done is None or done > at:
                where = f"its line at step {done}" if done is not None else \
                    "no line: the run ended inside it"
                raise EditError(
                    f"step {at} was recorded while tool call {call} was under way ({where}), "
                    f"and side-effecting tool {obs.get('name')!r} had been called inside it "
                    f"(step {obs['seq']}); a fork there would run its body again, and the "
                    f"side effect with it. Fork at a step before {obs['seq']}"
                    + (f" or after {done}" if done is not None else ""))
            call = tree.parent.get(call)


def _fits_a_line(at: int, detail: Mapping[str, Any], edited: Observation) -> None:
    """Refuse, before anything is written, a fork whose lines a reader would refuse: the
    edited step, and the ``fork_edit`` line, which holds the patch and the step's document
    (tuples and all, as they are written) two levels down."""
    try:
        deep = text_nests_deeper(canonical(dict(detail)), LINE_DEPTH - 1) \
            or text_nests_deeper(canonical(dict(edited)), LINE_DEPTH)
    except UnserializableValue as exc:
        raise EditError(f"step {at}: the edit holds a value a cassette cannot store "
                        f"({exc})") from None
    if deep:
        raise EditError(f"step {at}: its document or the edit nests deeper than the "
                        f"{LINE_DEPTH} levels a cassette line holds; a fork cannot record it")


def _step(parent: Cassette, at: int) -> Observation:
    n = len(parent.observations)
    if not 0 <= at < n:
        raise NoSuchStep(f"{parent.path}: fork step {at} is out of range; the run has steps "
                         f"0-{n - 1} (see `deja show {parent.path}`)")
    return parent.observations[at]


def _fork_path(parent: Cassette, out: str | Path | None, run_id: str) -> Path:
    """Where the fork is written: ``out`` (a file, or a directory for ``<run>.jsonl``),
    else next to its parent; never over an existing file, never over the parent."""
    target = run_file(out if out is not None else parent.path.parent, run_id)
    if target.exists():
        raise PathTaken(f"{target} already exists; choose another -o")
    if target.resolve() == parent.path.resolve():
        raise PathTaken("a fork never writes its parent; choose another -o")
    return target


def fork(cassette: str | Path, at: int, *, patch: list[dict[str, Any]] | None = None,
         replace: Any = None, sets: list[str] | tuple[str, ...] = (),
         out: str | Path | None = None, then_replay: str | Path | None = None,
         keyring: Keyring | None = None, fsync: str = "turn",
         allow_torn: bool = False, tools: ToolPolicy | None = None,
         live_tools: Sequence[str] = ()) -> Scope[ContinuationSession]:
    """Fork ``cassette`` at step ``at`` with an edit; see the module docstring.
    ``tools`` and ``live_tools``: the tool policy of the live part
    (:mod:`replayer.tool_policy`; by default a side effect is never run live)."""
    policy = ToolPolicy.parse(live=live_tools) if tools is None else tools
    if tools is not None and live_tools:
        policy = ToolPolicy({**tools.rules, **ToolPolicy.parse(live=live_tools).rules})
    ring = keyring or load_keyring(create=False)
    plan = plan_fork(cassette, at, patch=patch, replace=replace, sets=sets, out=out,
                     keyring=ring, allow_torn=allow_torn)
    # Its steps are re-signed into the fork: it must verify like the parent.
    other = (load(then_replay, keyring=ring, require_signature=True, allow_incomplete=True)
             if then_replay else None)
    return continuation.scope(
        lambda: start_fork(plan, then_replay=other, keyring=ring, fsync=fsync,
                           tools=policy),
        abandon_on_divergence=False, name=f"fork({cassette})")


def start_fork(plan: ForkPlan, *, then_replay: Cassette | None = None,
               keyring: Keyring | None = None, fsync: str = "turn",
               ran_in: Path | None = None,
               tools: ToolPolicy | None = None) -> ContinuationSession:
    """Write the fork's prefix and return its (not yet started) session. ``ran_in``: the
    directory the fork's command runs in (default: the parent's, else this one);
    ``tools``: the tool policy of its live part (default: side effects never live)."""
    tools = tools if tools is not None else ToolPolicy()
    ring = keyring or load_keyring()
    parent, at = plan.parent, plan.at
    signing = ring.signing or continuation.signing_key(parent, ring)
    header = {k: v for k, v in parent.header.items() if k not in ("format", "key_id")}
    header.update(run=plan.run_id, created=utc_stamp(), parent={"run": parent.run, "step": at,
                                           "prefix_sig": parent.sigs[at],
                                           "path": str(parent.path)},
                  tools=tools.to_header())
    if ran_in is None:
        try:  # the fork re-runs the parent's command: from the parent's directory
            ran_in = launch_dir(parent.path, parent.header)
        except CannotLaunch:  # a copied parent: where this runs
            ran_in = Path.cwd()
    launch = portable_launch([], ran_in, plan.out)
    header.update(cwd=launch["cwd"], cassette=launch["cassette"])
    writer = CassetteWriter(plan.out, header, signing, fsync)
    try:
        for obs in parent.observations[:at]:
            writer.append_copy(obs, parent.requests.get(obs["seq"]))
        writer.append_copy(plan.edited, parent.requests.get(at))
        # the bookkeeping line keeps what was edited: the patch, and the step's document
        # as the parent recorded it (the edited step above is what the agent saw)
        writer.append({"kind": Kind.CONTROL.value, "event": Control.FORK_EDIT.value,
                       "detail": {"parent": parent.run, "step": at, "patch": plan.patch,
                                  "original": _edit.view(plan.original)}},
                      sync=True)
        prefix = dataclasses.replace(parent, end=None,
                                     observations=(*parent.observations[:at], plan.edited))
        recorded = (parent, then_replay) if then_replay is not None else (parent,)
        return ContinuationSession(prefix, writer, then_replay=then_replay, fsync=fsync,
                                   keyring=ring, tool_policy=tools, recorded_runs=recorded)
    except BaseException:  # a prefix that cannot be written, settings refused ([tool.deja]):
        writer.discard()  # no half a fork left behind
        raise
