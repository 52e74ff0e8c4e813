"""deja's replayer: serve a recorded run back to the agent's code, offline and exactly;
fork it at a step with an edited observation; resume it after a crash."""

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
