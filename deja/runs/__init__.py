"""Runs out of the request cycle: submit a run and get its id at once, durable workers that
pick it up again when one dies, schedules with absence alerts.

``deja.runs.engine`` is the only module that imports the durable-execution engine (DBOS
Transact); everything else here speaks of runs, workers and schedules.
"""

__all__: list[str] = []
