"""The harness: what keeps a long run under control, decided at its observation boundaries.

- :mod:`.settings`: the harness settings, from ``record(...)``, ``[tool.deja]`` and flags;
- :mod:`.guards`: budgets, the loop guard and the circuit breaker;
- :mod:`.run_guard`: the guards of one recorded run, applied at its boundaries;
- :mod:`.progress`: what a run is doing, and the cancel flag.
"""

__all__: list[str] = []  # nothing is re-exported: import from the modules
