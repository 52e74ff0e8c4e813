"""deja's replayer: serve a recorded run back to the agent's code, offline and exactly."""

from recorder.errors import Divergence, DivergenceInfo

from .replay import ReplayResult, ReplaySession, replay, start

__all__ = ["Divergence", "DivergenceInfo", "ReplayResult", "ReplaySession", "replay", "start"]
