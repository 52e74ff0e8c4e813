"""deja's replayer: serve a recorded run back to the agent's code, offline and exactly;
fork it at a step with an edited observation; resume it after a crash."""

from recorder.errors import Divergence, DivergenceInfo
from replayer.continuation import ContinuationSession
from replayer.diff import RunDiff, compare
from replayer.forking import ForkPlan, fork, plan_fork, plan_resume, resume
from replayer.replay import ReplayResult, ReplaySession, replay, start

__all__ = [
    "ContinuationSession",
    "Divergence",
    "DivergenceInfo",
    "ForkPlan",
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
