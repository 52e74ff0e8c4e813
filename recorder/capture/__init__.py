"""Capture: the seam between an agent's calls and the observation log.

- :mod:`.session`: a :class:`~recorder.capture.session.Session` and the one that is active;
  recording, replay, fork and resume are each one;
- :mod:`.vcr`: vcrpy's patchers, driven by the active session; :mod:`._httpx` is deja's
  own stub for the httpx transports;
- :mod:`.exchange`: one HTTP exchange as deja sees it, whichever client made it;
- :mod:`.redact`: what never reaches disk: the rules of a run and how they are applied;
  :mod:`._secrets` holds the built-in ones, what looks like a secret.
"""

__all__: list[str] = []
