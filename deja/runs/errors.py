"""The named errors of runs out of the request cycle; each says what to do about it."""

from __future__ import annotations

from recorder.errors import ConfigError, DejaError, UsageError


class BadRunRequest(UsageError):
    """A submission that cannot become a run (no command, a bad guard, a secret in argv)."""


class BadSchedule(UsageError):
    """A schedule that cannot be kept: an invalid cron expression, time zone or deadline."""


class NoSuchSchedule(UsageError):
    """A schedule name that the database does not hold."""


class DatabaseUnavailable(DejaError):
    """The runs database cannot be reached (a Postgres server down, a file unreadable)."""


class CassettesNotShared(ConfigError):
    """The cassette directory is not the one the other workers write to."""


class WorkerIdTaken(UsageError):
    """Another live worker already uses this worker id."""


class ServerUnreachable(DejaError):
    """``deja serve`` does not answer at the address a command was given."""


class RunFailed(DejaError):
    """A run that ended in failure (the program raised, exited non-zero, or never started)."""
