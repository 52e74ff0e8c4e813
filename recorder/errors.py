"""Every error deja raises, under one root.

::

    DejaError
    ├── UsageError               asked for something that cannot be done as asked
    │   ├── ConfigError          bad settings or arguments, found before anything runs
    │   ├── EditError            an edit of a step that is not a patch, or does not apply
    │   ├── NoSuchStep           a step number the run does not have
    │   ├── NoSuchRun            a run id nothing knows
    │   ├── PathTaken            a file that would be overwritten (a new cassette's path)
    │   ├── NotResumable         a run that already ended: there is nothing to resume
    │   ├── CannotLaunch         the recorded command cannot be started from here
    │   └── VcrImportError       a vcrpy cassette that cannot be imported as it is
    │       ├── NotAVcrCassette  not YAML, no interactions, or none in it
    │       ├── CannotConvert    one interaction (named by its index) cannot become a line
    │       └── YamlExpansion    its aliases expand it far beyond its size ("billion laughs")
    ├── KeyMissing               no signing key where one is required
    ├── CassetteError            a cassette file that cannot be trusted or written as it is
    │   ├── CassetteNotFound     no file at that path (the closest names are suggested)
    │   ├── CorruptCassette      a line that is not valid JSON or breaks the format
    │   │   └── TornCassette     the last line was cut short (a crash mid-write)
    │   ├── SignatureError       the HMAC chain does not verify: edited, inserted,
    │   │                        deleted or reordered lines, or an edited key id
    │   ├── UnverifiedCassette   signed with a key this machine does not have: it is
    │   │                        refused unless the user allows unverified cassettes
    │   ├── UnsupportedFormat    a format version this deja does not read
    │   ├── CassetteLocked       another process is writing this cassette
    │   ├── CassetteWriteError   a line could not be written (disk full, read-only, I/O
    │   │                        error); the run stops, the file keeps its whole lines
    │   └── NotRepairable        deja repair will not cut it: what follows its verified
    │                            lines looks like edited lines, not what a power loss leaves
    ├── UnserializableValue      a tool result or effect value that cannot be stored
    ├── SessionError             record/replay used wrongly (nested, not active, a closed
    │                            cassette written to)
    ├── Divergence               replay: the agent asked for something the cassette
    │                            does not hold at that point
    ├── ToolReplayError          replay: a recorded tool raised; the original exception
    │                            class could not be rebuilt, so this stands in for it
    ├── ToolRefused              a fork, replay-then-live or suite did not run a tool: its
    │                            tool policy refuses it (a side effect not named live)
    ├── ExportFailed             a run's spans could not be delivered to the tracing
    │                            backend (unreachable, or it refused them)
    ├── ResponseTooLarge         the recording proxy: an upstream response over its limit
    │                            (as received, or a gzip or deflate body inflated)
    └── RunStopped               the harness ended the run at a boundary
        ├── NeedsAttention       resume met a side effect it cannot settle by itself
        ├── BudgetExhausted      a budget (turns, tokens, max_tokens, seconds, dollars)
        ├── Cancelled            someone asked the run to stop
        ├── LoopDetected         the same tool call keeps repeating
        └── CircuitOpen          the upstream failed too often; calls fail fast

A ``RunStopped`` carries the ``end_status`` its run ends with (``needs_attention``,
``exhausted``, ``cancelled``, ``stopped``).

Outside the tree, as it must be: :class:`Interrupted`, a ``KeyboardInterrupt`` raised in a
recorded program that ``deja record`` (or fork, resume) passed a SIGTERM, SIGHUP or SIGINT
to; the run ends ``interrupted`` and can be resumed.

Messages say what happened, where (file, run, seq) and what to do next.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


class DejaError(Exception):
    """Root of every error deja raises."""


class UsageError(DejaError):
    """deja was asked for something that cannot be done as asked; the message says what
    to give instead."""


class ConfigError(UsageError):
    """Invalid settings or arguments: ``[tool.deja]``, the environment, ``record()``'s
    arguments, command-line flags."""


class EditError(UsageError):
    """An edit of a step (fork) that is not a JSON patch, or that does not apply to it."""


class NoSuchStep(UsageError):
    """A step number the run does not have."""


class NoSuchRun(UsageError):
    """A run id that no cassette or status record knows."""


class PathTaken(UsageError):
    """The path a new cassette would be written to already exists."""


class NotResumable(UsageError):
    """The run already ended (completed, failed, stopped): there is nothing to resume."""


class CannotLaunch(UsageError):
    """The command a cassette records cannot be started from here (unknown or moved
    directory, missing script)."""


class VcrImportError(UsageError):
    """A vcrpy cassette that cannot be imported as it is."""


class NotAVcrCassette(VcrImportError):
    """The file is not a vcrpy cassette (not YAML, no ``interactions``, or none in it)."""


class CannotConvert(VcrImportError):
    """One interaction of the cassette cannot become a deja line (named by its index)."""


class YamlExpansion(VcrImportError):
    """The YAML's aliases (``*name`` for an ``&name`` anchor) would expand it to far more
    than its own size: a "billion laughs" file, refused before anything is built."""


class KeyMissing(DejaError):
    """A signing key is required and none is available."""


class CassetteError(DejaError):
    """A cassette cannot be used as it is."""

    def __init__(self, message: str, *, path: str | Path | None = None, seq: int | None = None):
        self.path = str(path) if path is not None else None
        self.seq = seq
        super().__init__(message)


class CassetteNotFound(CassetteError):
    """There is no cassette at the path given."""


class CorruptCassette(CassetteError):
    """A line is not valid JSON or breaks the cassette format."""


class TornCassette(CorruptCassette):
    """The last line was cut short, as a crash in the middle of a write leaves it."""

    def __init__(self, message: str, *, path: str | Path | None = None, seq: int | None = None,
                 offset: int = 0):
        self.offset = offset
        super().__init__(message, path=path, seq=seq)


class SignatureError(CassetteError):
    """The signature chain does not verify."""


class UnverifiedCassette(CassetteError):
    """The cassette's signature cannot be checked here: nobody on this machine has its key.

    Such a file may come from another machine, or may have been re-signed by someone else;
    deja neither serves nor runs it unless the user allows unverified cassettes.
    """


class UnsupportedFormat(CassetteError):
    """The cassette was written in a format version this deja cannot read."""


class CassetteLocked(CassetteError):
    """Another process holds the cassette's writer lock."""

    def __init__(self, message: str, *, path: str | Path | None = None,
                 holder: dict[str, object] | None = None):
        self.holder = dict(holder or {})
        super().__init__(message, path=path)


class CassetteWriteError(CassetteError):
    """Writing a line failed; the file was cut back to its last whole line."""


# ``deja record``/``resume`` exits with this (sysexits' EX_IOERR) when its cassette could
# not be written as the run started: nothing ran; a worker dispatches the run again once
# the directory takes a write.
EXIT_CASSETTE_UNWRITABLE = 74


class NotRepairable(CassetteError):
    """``deja repair`` refuses to cut a cassette: after the lines that verify comes
    something that looks like lines deja wrote (the file was edited), not junk."""


class UnserializableValue(DejaError):
    """A value that a cassette cannot hold faithfully."""


class SessionError(DejaError):
    """Recording or replay was used in a way that cannot work."""


@dataclass(frozen=True)
class DivergenceInfo:
    """The facts of a divergence, kept on the exception and in a ReplayResult."""

    step: int | None
    kind: str
    reason: str
    expected: object
    actual: object
    diff: str
    # the recorded request nearest to the one sent, ranked field by field, and how it differs
    nearest: str | None = None
    # the kind of change (replayer.verdicts.Change: different_tool, different_arguments,
    # extra_call, missing_call, reordered, changed_request) and, for a changed request,
    # what changed (model, prompt, parameters: ...)
    category: str | None = None
    changed: tuple[str, ...] = ()
    # the nearest recorded call's step, the fields it differs in, and how many times the
    # recorded call(s) it stands for were already played in this replay
    nearest_step: int | None = None
    fields: tuple[str, ...] = ()
    played: int | None = None


class Divergence(DejaError):
    """The agent asked for something the cassette does not hold at this point of the run."""

    def __init__(self, info: DivergenceInfo, *, path: str | Path | None = None):
        self.info = info
        self.path = str(path) if path is not None else None
        super().__init__(self._message())

    @property
    def step(self) -> int | None:
        return self.info.step

    @property
    def diff(self) -> str:
        return self.info.diff

    def _message(self) -> str:
        where = f"step {self.info.step}" if self.info.step is not None else "after the last step"
        kind = self.info.kind + (f", {self.info.category.replace('_', ' ')}"
                                 if self.info.category else "")
        head = f"replay diverged at {where} ({kind}): {self.info.reason}"
        if self.path:
            head += f"\n  cassette: {self.path}"
        if self.info.nearest:
            head += f"\n  {self.info.nearest}"
        body = f"\n{self.info.diff}" if self.info.diff else ""
        hint = ("\n  The agent's code or inputs changed since this run was recorded. "
                "Re-record it, or fork the run at this step to test the change.")
        return head + body + hint


class ToolReplayError(DejaError):
    """A recorded tool raised an exception whose class could not be rebuilt on replay."""

    def __init__(self, tool: str, error_type: str, message: str):
        self.tool = tool
        self.error_type = error_type
        super().__init__(f"{error_type}: {message} (recorded error of tool {tool!r})")


class ToolRefused(DejaError):
    """A tool call a fork, a replay-then-live or a suite did not run: its tool policy
    refuses it (a side-effecting tool is never live there unless named). The agent sees it
    as the tool's error; the cassette holds it as the tool's line, marked ``policy``."""

    def __init__(self, message: str, *, tool: str | None = None) -> None:
        self.tool = tool
        super().__init__(message)


def sdk_passthrough(exc: DejaError) -> DejaError:
    """Return ``exc`` as an instance the anthropic SDK re-raises untouched.

    The SDK wraps any exception raised by its HTTP transport in ``APIConnectionError`` and
    retries it, except its own ``AnthropicError`` family. A divergence or a guard decision
    must reach the agent at once and as itself, so it is re-classed into a subclass of both
    its own type and ``AnthropicError``; ``except Divergence`` still catches it.
    """
    try:
        import anthropic
    except ImportError:  # pragma: no cover - anthropic is a dependency
        return exc
    cls = type(exc)
    if isinstance(exc, anthropic.AnthropicError):
        return exc
    sub = _PASSTHROUGH.get(cls)
    if sub is None:
        sub = type(cls.__name__, (cls, anthropic.AnthropicError), {"__module__": cls.__module__})
        _PASSTHROUGH[cls] = sub
    exc.__class__ = sub
    return exc


_PASSTHROUGH: dict[type, type] = {}


class ExportFailed(DejaError):
    """A run's spans could not be delivered: the endpoint is unreachable, or refused them."""


class ResponseTooLarge(DejaError):
    """An upstream response the recording proxy refused: its body, as received or as it
    inflates (gzip, deflate), is over ``limit`` bytes (``deja proxy --max-response``)."""

    def __init__(self, message: str, *, limit: int):
        self.limit = limit
        super().__init__(message)


class RunStopped(DejaError):
    """The harness stopped the run at a boundary; the run ends with ``end_status``."""

    end_status = "stopped"

    def __init__(self, message: str, *, reason: str | None = None,
                 detail: dict[str, object] | None = None):
        self.reason = reason or type(self).__name__
        self.detail = dict(detail or {})
        super().__init__(message)


class NeedsAttention(RunStopped):
    """A side effect's fate is unknown; a person has to decide."""

    end_status = "needs_attention"


class BudgetExhausted(RunStopped):
    end_status = "exhausted"


class Cancelled(RunStopped):
    end_status = "cancelled"


class LoopDetected(RunStopped):
    end_status = "stopped"


class CircuitOpen(RunStopped):
    end_status = "stopped"


class Interrupted(KeyboardInterrupt):
    """A signal asked the recorded program to stop; its run ends ``interrupted``."""

    def __init__(self, signum: int) -> None:
        import signal

        self.signum = signum
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        super().__init__(f"stopped by {name}")
