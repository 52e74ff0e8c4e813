"""deja's replayer: serve a recorded run back to the agent's code, offline and exactly;
fork it at a step with an edited observation; resume it after a crash.

Each name below is imported from its module when it is first used (``replayer.fork``
imports the fork, not the diff or the resume).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from recorder.imports import import_on_first_use

if TYPE_CHECKING:  # what a type checker sees; at run time, each is imported on first use
    from recorder.errors import Divergence, DivergenceInfo
    from replayer.continuation import ContinuationSession
    from replayer.diff import RunDiff, compare
    from replayer.fork import ForkPlan, fork, plan_fork
    from replayer.network import NetworkBlocked
    from replayer.policy import ReplayPolicy
    from replayer.replay import ReplaySession, replay, start
    from replayer.result import ReplayResult
    from replayer.resume import plan_resume, resume

__all__ = [
    "ContinuationSession",
    "Divergence",
    "DivergenceInfo",
    "ForkPlan",
    "NetworkBlocked",
    "ReplayPolicy",
    "ReplayResult",
    "ReplaySession",
    "RunDiff",
    "compare",
    "fork",
    "plan_fork",
    "plan_resume",
    "replay",
    "resume",
    "start",
]

import_on_first_use(__name__, {
    "recorder.errors": ("Divergence", "DivergenceInfo"),
    "replayer.continuation": ("ContinuationSession",),
    "replayer.diff": ("RunDiff", "compare"),
    "replayer.fork": ("ForkPlan", "fork", "plan_fork"),
    "replayer.network": ("NetworkBlocked",),
    "replayer.policy": ("ReplayPolicy",),
    "replayer.replay": ("ReplaySession", "replay", "start"),
    "replayer.result": ("ReplayResult",),
    "replayer.resume": ("plan_resume", "resume"),
})
