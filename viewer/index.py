"""The DuckDB index over a directory of cassettes: a cache, never the truth.

The index of ``DIR`` lives under ``$DEJA_HOME/index/`` (see :func:`index_path`), not in
``DIR``: a cassette folder is often committed, and its index (a database of every payload,
and its WAL) has no place in a repository. It holds one row per run and one per step,
refreshed incrementally: a file is re-read only when its size or modification time
changed. A step row keeps the expanded observation (``payload``) and the words a text
search should find (``text``: messages, thinking, tool inputs and results; see
:func:`viewer.content.searchable_text`). An index of an older layout is rebuilt.
Delete the index at any time; the next refresh rebuilds it from the files. A file that
cannot be read (torn, tampered, unknown format) becomes a run row with ``status = 'error'``
and the reason, and the rest of the directory is indexed as usual.

DuckDB lets one process hold a database for writing. When another process (a viewer,
say) holds it, :class:`RunIndex` builds the same index in memory instead.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import duckdb

from recorder.cassette import Cassette, load
from recorder.cassette.keys import Keyring, deja_home, load_keyring
from recorder.cassette.rows import run_summary, step_row
from recorder.cassette.trust import allow_unverified_from_env
from recorder.errors import DejaError
from viewer.content import searchable_text

log = logging.getLogger("deja.viewer")

LEGACY_NAME = ".index.duckdb"  # where deja kept the index before: inside DIR itself
SCHEMA_VERSION = 5  # 2: steps.text, the searchable words of each step; 3: steps.t,
#   edited, within (what the timeline shows, so that it never parses a payload); 4: a run
#   that ended in error has status failed (the one vocabulary of run statuses); 5: a model
#   step's words read through its provider's conversation (Gemini's, Bedrock's)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key VARCHAR PRIMARY KEY, value VARCHAR);
CREATE TABLE IF NOT EXISTS files (
    path VARCHAR PRIMARY KEY, size BIGINT, mtime_ns BIGINT, run VARCHAR);
CREATE TABLE IF NOT EXISTS runs (
    run VARCHAR, path VARCHAR, status VARCHAR, created VARCHAR, steps INTEGER,
    model_calls INTEGER, tool_calls INTEGER, input_tokens BIGINT, output_tokens BIGINT,
    cost_usd DOUBLE, duration_s DOUBLE, errors INTEGER, parent_run VARCHAR,
    parent_step INTEGER, models VARCHAR, labels VARCHAR, verified BOOLEAN,
    verify_note VARCHAR, error VARCHAR);
CREATE TABLE IF NOT EXISTS steps (
    run VARCHAR, path VARCHAR, seq INTEGER, kind VARCHAR, name VARCHAR, status VARCHAR,
    input_tokens BIGINT, output_tokens BIGINT, cost_usd DOUBLE, ms DOUBLE, error VARCHAR,
    payload VARCHAR, text VARCHAR, t DOUBLE, edited BOOLEAN, within VARCHAR);
"""

_RUN_COLUMNS = ("run", "path", "status", "created", "steps", "model_calls", "tool_calls",
                "input_tokens", "output_tokens", "cost_usd", "duration_s", "errors",
                "parent_run", "parent_step", "models", "labels", "verified", "verify_note",
                "error")
_STEP_COLUMNS = ("run", "path", "seq", "kind", "name", "status", "input_tokens",
                 "output_tokens", "cost_usd", "ms", "error", "payload", "text", "t", "edited",
                 "within")
_FILE_COLUMNS = ("path", "size", "mtime_ns", "run")
BATCH_STEPS = 50_000  # step rows written per transaction while a large folder is indexed
PARALLEL_MIN = 2000  # files to read from which starting worker processes pays
MAX_WORKERS = 4
_CHUNK = 64  # files a worker reads per message

Rows = tuple[dict[str, Any], list[dict[str, Any]]]
"""A file's run row and step rows."""

Progress = Callable[[int, int], None]
"""``progress(done, total)``: ``total`` files to (re)read, ``done`` of them read so far."""


def index_dir() -> Path:
    """Where the indexes live: ``$DEJA_HOME/index`` (default ``~/.deja/index``)."""
    return deja_home() / "index"


def index_path(directory: str | Path) -> Path:
    """The index of ``directory``: ``$DEJA_HOME/index/<name>-<hash>.duckdb``.

    ``<name>`` is the folder's own name (for a person listing the cache), ``<hash>`` the
    first 16 hex digits of the SHA-256 of its resolved path, so two folders of the same
    name, or one reached by two paths, never share or split an index.
    """
    resolved = Path(directory).resolve()
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", resolved.name).strip("._") or "root"
    digest = hashlib.sha256(str(resolved).encode("utf-8", "surrogateescape")).hexdigest()
    return index_dir() / f"{name[:40]}-{digest[:16]}.duckdb"


def _private_dir(path: Path) -> None:
    """Create ``path`` with mode 0700; one made more open is closed to others."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.stat().st_mode & 0o077:
        os.chmod(path, 0o700)


class RunIndex:
    """Runs and steps of one cassette directory, in DuckDB."""

    def __init__(self, directory: str | Path, *, db_path: str | Path | None = None,
                 keyring: Keyring | None = None, allow_unverified: bool | None = None) -> None:
        self.directory = Path(directory)
        self.db_path = Path(db_path) if db_path else index_path(self.directory)
        self._keyring = keyring if keyring is not None else load_keyring(create=False)
        self.allow_unverified = (allow_unverified if allow_unverified is not None
                                 else allow_unverified_from_env())
        self.in_memory = False
        try:
            if db_path is None:
                self._forget_legacy()
                _private_dir(self.db_path.parent)
            self.con = duckdb.connect(str(self.db_path))
        except OSError as exc:  # $DEJA_HOME read-only or full: the index still works
            log.warning("index %s cannot be created (%s); indexing in memory",
                        self.db_path, getattr(exc, "strerror", None) or exc)
            self.con = duckdb.connect(":memory:")
            self.in_memory = True
        except duckdb.IOException as exc:
            log.info("index %s is held by another process (%s); indexing in memory",
                     self.db_path, exc)
            self.con = duckdb.connect(":memory:")
            self.in_memory = True
        self._ensure_schema()

    def _forget_legacy(self) -> None:
        """Remove an index an older deja left inside the cassette folder (a cache: the
        new one is rebuilt from the files), so its payloads do not linger there."""
        for leftover in (self.directory / LEGACY_NAME,
                         self.directory / f"{LEGACY_NAME}.wal"):
            try:
                leftover.unlink()
            except FileNotFoundError:
                continue
            except OSError as exc:
                log.warning("cannot remove the old index %s (%s); delete it by hand",
                            leftover, exc.strerror or exc)
            else:
                log.info("removed the old index %s (the index now lives in %s)",
                         leftover, self.db_path)

    def __enter__(self) -> RunIndex:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self.con.close()

    def _ensure_schema(self) -> None:
        self.con.execute("CREATE TABLE IF NOT EXISTS meta (key VARCHAR PRIMARY KEY, "
                         "value VARCHAR)")
        row = self.con.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()
        if row is None or row[0] != str(SCHEMA_VERSION):  # an older layout: rebuild it all
            for table in ("files", "runs", "steps"):
                self.con.execute(f"DROP TABLE IF EXISTS {table}")
            self.con.execute("INSERT OR REPLACE INTO meta VALUES ('schema', ?)",
                             [str(SCHEMA_VERSION)])
        self.con.execute(_SCHEMA)
        # What a row says about a file's signature depends on the keys at hand and on
        # whether unverified files are allowed: when either changed, every file is read
        # again (a new key can verify a file, a removed one must stop doing so).
        trust = json.dumps({"keys": sorted(self._keyring.accepted),
                            "allow_unverified": self.allow_unverified})
        row = self.con.execute("SELECT value FROM meta WHERE key = 'trust'").fetchone()
        if row is None or row[0] != trust:
            self.con.execute("DELETE FROM files")
            self.con.execute("INSERT OR REPLACE INTO meta VALUES ('trust', ?)", [trust])

    # -- refresh

    def refresh(self, progress: Progress | None = None) -> dict[str, int]:
        """Bring the index up to date with the files; returns what it did.

        ``progress(done, total)``, when given, is called once with ``done = 0`` before
        the first of ``total`` new or changed files is read, then after each (not at all
        when nothing changed), so that a command can draw a progress bar.

        The index forgets what its cassettes forget: when a file is deleted, or rewritten
        other than by appending, its old rows are deleted and the database is compacted
        (``compacted`` in the result), so their bytes are gone from the database and its
        WAL. The index's folder is its owner's only (0700), its files too (0600).

        Many files to read (:data:`PARALLEL_MIN`) are read by worker processes, one per CPU
        (up to :data:`MAX_WORKERS`), and written in batches of about :data:`BATCH_STEPS`
        step rows, each batch in one transaction with all the rows of its files.
        """
        self._private_files()
        known = {r[0]: (r[1], r[2]) for r in
                 self.con.execute("SELECT path, size, mtime_ns FROM files").fetchall()}
        seen: set[str] = set()
        stats = {"indexed": 0, "unchanged": 0, "removed": 0, "errors": 0}
        todo: list[tuple[Path, os.stat_result]] = []
        for key, st in self._listing():
            seen.add(key)
            if known.get(key) == (st.st_size, st.st_mtime_ns):
                stats["unchanged"] += 1
                continue
            todo.append((Path(key), st))
        gone = [p for p in known if p not in seen]
        stats["removed"] = len(gone)
        if progress is not None and todo:
            progress(0, len(todo))
        # Written in batches, each in one transaction with every row of its files: a large
        # folder's rows are never all in memory at once, and each file changes atomically.
        forgets = False
        batch = _Batch()
        for done, ((path, st), (run_row, steps)) in enumerate(
                zip(todo, self._read_all([p for p, _ in todo]), strict=True), 1):
            stats["indexed"] += 1
            stats["errors"] += run_row["error"] is not None
            batch.add(str(path), st, run_row, steps)
            if progress is not None:
                progress(done, len(todo))
            if len(batch.steps) >= BATCH_STEPS:
                forgets |= self._store(batch, gone)
                batch, gone = _Batch(), []
        if batch.files or gone:
            forgets |= self._store(batch, gone)
        stats["compacted"] = 0
        if forgets and not self.in_memory:
            stats["compacted"] = 1
            if not self._compact():  # another process took the file meanwhile
                return self.refresh(progress)
        self._private_files()
        return stats

    def _listing(self) -> list[tuple[str, os.stat_result]]:
        """The path of each ``*.jsonl`` file of the folder (as ``str(directory / name)``)
        and its stat, by name; a file deleted since the listing is left out."""
        found = []
        with os.scandir(self.directory) as entries:
            for entry in entries:
                if not entry.name.endswith(".jsonl"):
                    continue
                try:
                    found.append((entry.name, entry.stat()))
                except FileNotFoundError:
                    continue
        found.sort()
        prefix = str(self.directory / "x")[:-1]  # the folder as pathlib spells it, and "/"
        return [(prefix + name, st) for name, st in found]

    def _read_all(self, paths: list[Path]) -> Iterator[Rows]:
        """The rows of each file, in order: read by worker processes when there are many
        files and more than one CPU (reading is CPU-bound Python: parsing, checking the
        signature chain), else here."""
        done = 0
        workers = min(os.cpu_count() or 1, MAX_WORKERS)
        if len(paths) >= PARALLEL_MIN and workers > 1:
            try:
                for rows in _read_in_workers(paths, self._keyring, self.allow_unverified,
                                             workers):
                    yield rows
                    done += 1
            except (OSError, EOFError, pickle.PickleError, ValueError) as exc:
                log.warning("indexing in worker processes failed (%s); reading the rest of "
                            "the %d files here", exc, len(paths) - done)
        for path in paths[done:]:
            yield read_rows(path, self._keyring, self.allow_unverified)

    def _store(self, batch: _Batch, gone: list[str]) -> bool:
        """Replace the rows of the batch's files (and delete those of ``gone`` files) in
        one transaction; True when the rows replaced held anything the new ones do not."""
        stale = batch.files_paths() + gone
        forgets = bool(stale) and self._forgets(stale, batch.runs, batch.steps)
        self.con.execute("BEGIN TRANSACTION")
        try:
            if stale:
                for table in ("files", "runs", "steps"):
                    self.con.execute(f"DELETE FROM {table} WHERE path IN "
                                     f"(SELECT unnest(?::VARCHAR[]))", [stale])
            self._append("files", _FILE_COLUMNS, batch.files)
            self._append("runs", _RUN_COLUMNS, batch.runs)
            self._append("steps", _STEP_COLUMNS, batch.steps)
            self.con.execute("COMMIT")
        except BaseException:
            self.con.execute("ROLLBACK")
            raise
        return forgets

    # -- forgetting

    def _forgets(self, stale: list[str], run_rows: list[dict[str, Any]],
                 step_rows: list[dict[str, Any]]) -> bool:
        """Do the rows about to be replaced hold anything the new ones do not (a deleted
        file, a rewritten one), rather than being a prefix of them (a file that grew)?"""
        old_steps = self.con.execute(
            "SELECT path, seq, md5(payload) FROM steps WHERE payload IS NOT NULL AND path IN "
            "(SELECT unnest(?::VARCHAR[]))", [stale]).fetchall()
        if old_steps:
            had = {path for path, _, _ in old_steps}
            new_steps = {(r["path"], r["seq"]): hashlib.md5(r["payload"].encode("utf-8"))
                         .hexdigest() for r in step_rows
                         if r["path"] in had and r.get("payload") is not None}
            if any(new_steps.get((path, seq)) != digest for path, seq, digest in old_steps):
                return True
        old_runs = self.con.execute(
            "SELECT path, run, created, labels FROM runs WHERE path IN "
            "(SELECT unnest(?::VARCHAR[]))", [stale]).fetchall()
        new_runs = {r["path"]: _run_identity(r) for r in run_rows}
        return any(path not in new_runs
                   or new_runs[path] != _run_identity({"run": run, "created": created,
                                                       "labels": labels})
                   for path, run, created, labels in old_runs
                   if (run, created, labels) != (None, None, None))

    def _compact(self) -> bool:
        """Rewrite the database with only its live rows and put it in place of the old
        file, whose free blocks still hold deleted rows. False when the file could not be
        opened again (another process holds it): the index then lives in memory."""
        fresh = self.db_path.with_name(self.db_path.name + ".compact")
        for leftover in (fresh, Path(f"{fresh}.wal")):
            leftover.unlink(missing_ok=True)
        row = self.con.execute("SELECT current_database()").fetchone()
        assert row is not None  # the query always gives one row
        name = row[0]
        target = str(fresh).replace("'", "''")
        self.con.execute(f"ATTACH '{target}' AS deja_compact")
        try:
            os.chmod(fresh, 0o600)
            quoted = '"' + str(name).replace('"', '""') + '"'
            self.con.execute(f"COPY FROM DATABASE {quoted} TO deja_compact")
        finally:
            self.con.execute("DETACH deja_compact")
        self.con.close()
        os.replace(fresh, self.db_path)
        # The old file's WAL was checkpointed on close; none may be replayed onto the new one.
        Path(f"{self.db_path}.wal").unlink(missing_ok=True)
        try:
            self.con = duckdb.connect(str(self.db_path))
        except duckdb.IOException as exc:
            log.info("index %s was taken by another process while compacting (%s); "
                     "indexing in memory", self.db_path, exc)
            self.con = duckdb.connect(":memory:")
            self.in_memory = True
            self._ensure_schema()
            return False
        return True

    def _private_files(self) -> None:
        """The index and its WAL are readable by their owner only."""
        if self.in_memory:
            return
        for path in (self.db_path, Path(f"{self.db_path}.wal")):
            try:
                if path.stat().st_mode & 0o077:
                    os.chmod(path, 0o600)
            except FileNotFoundError:
                continue

    def _append(self, table: str, columns: tuple[str, ...], rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        import pyarrow as pa

        arrow = pa.table({c: [r.get(c) for r in rows] for c in columns})  # noqa: F841
        self.con.execute(f"INSERT INTO {table} SELECT {', '.join(columns)} FROM arrow")

    # -- queries

    def file_state(self, path: str | Path) -> tuple[Any, ...]:
        """What this index's rows of the file ``path`` were made from: the index, its
        layout, the file's size and modification time when it was read (None: not
        indexed) and the trust (keys at hand, unverified runs allowed). The rows are the
        same whenever this is, so it keys a cache of what is shown from them."""
        row = self.con.execute("SELECT size, mtime_ns FROM files WHERE path = ?",
                               [str(path)]).fetchone()
        trust = self.con.execute("SELECT value FROM meta WHERE key = 'trust'").fetchone()
        return (str(self.db_path), SCHEMA_VERSION, str(path), row,
                trust[0] if trust else None)

    def runs(self) -> list[dict[str, Any]]:
        cur = self.con.execute(
            "SELECT *, CAST(input_tokens + output_tokens AS BIGINT) AS tokens FROM runs "
            "ORDER BY created DESC NULLS LAST, path")
        return _dicts(cur)

    def steps(self, run: str) -> list[dict[str, Any]]:
        cur = self.con.execute("SELECT * EXCLUDE (payload, text, t, edited, within) FROM steps "
                               "WHERE run = ? ORDER BY seq", [run])
        return _dicts(cur)


class _Batch:
    """The rows of some files, to be written together."""

    def __init__(self) -> None:
        self.files: list[dict[str, Any]] = []
        self.runs: list[dict[str, Any]] = []
        self.steps: list[dict[str, Any]] = []

    def add(self, path: str, st: os.stat_result, run_row: dict[str, Any],
            steps: list[dict[str, Any]]) -> None:
        self.files.append({"path": path, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                           "run": run_row["run"]})
        self.runs.append(run_row)
        self.steps.extend(steps)

    def files_paths(self) -> list[str]:
        return [f["path"] for f in self.files]


def read_rows(path: Path, keyring: Keyring, allow_unverified: bool) -> Rows:
    """The run row and step rows of the cassette at ``path``; a file that cannot be read
    (at its load, or at a line found malformed when it is restored) is a run row with
    ``status = 'error'`` and the reason, and no steps."""
    try:
        cassette = load(path, keyring=keyring, allow_torn=True,
                        allow_unverified=allow_unverified)
        steps = _index_rows(cassette, str(path))
        summary = run_summary(cassette, rows=steps)
    except (DejaError, OSError) as exc:
        return {"run": None, "path": str(path), "status": "error",
                "error": f"{type(exc).__name__}: {exc}"}, []
    run_row = {c: summary.get(c) for c in _RUN_COLUMNS}
    run_row.update(path=str(path), models=",".join(summary["models"]),
                   labels=json.dumps(summary["labels"]), error=None)
    if cassette.torn_offset is not None:
        run_row["error"] = f"torn last line at byte {cassette.torn_offset}"
    return run_row, steps


def _index_rows(cassette: Cassette, path: str) -> list[dict[str, Any]]:
    """The step rows of the index: :func:`step_row` with what the viewer searches and
    shows of each line, which is restored whole once, here."""
    run = cassette.header.get("run")
    steps = []
    for obs in cassette.observations:
        row = step_row(obs)
        t, within = obs.get("t"), obs.get("within")
        row.update(run=run, path=path,
                   payload=json.dumps(obs, ensure_ascii=False), text=searchable_text(obs),
                   t=float(t) if isinstance(t, (int, float)) and not isinstance(t, bool)
                   else None,
                   edited=obs.get("edited") is True,
                   within=within if isinstance(within, str) or within is None
                   else json.dumps(within, ensure_ascii=False))
        steps.append(row)
    return steps


def _read_in_workers(paths: list[Path], keyring: Keyring, allow_unverified: bool,
                     workers: int) -> Iterator[Rows]:
    """:func:`read_rows` of each path, in order, by ``workers`` Python processes (started
    afresh, so nothing of this process but the keys and the paths goes to them)."""
    chunks = [paths[i:i + _CHUNK] for i in range(0, len(paths), _CHUNK)]
    workers = min(workers, len(chunks))
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])  # where the viewer package is
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    # -P: the working directory is not put on sys.path, so a folder being viewed (a clone
    # of someone else's repository) cannot stand in for deja's own modules, which get keys
    worker = [sys.executable, "-P", "-c", "from viewer.index import _worker; _worker()"]
    procs = [subprocess.Popen(worker, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
             for _ in range(workers)]
    try:
        for n, proc in enumerate(procs):  # each reads all its work before it answers
            assert proc.stdin is not None
            pickle.dump((keyring, allow_unverified, chunks[n::workers]), proc.stdin,
                        protocol=pickle.HIGHEST_PROTOCOL)
            proc.stdin.close()
        for k in range(len(chunks)):  # chunk k comes from worker k % workers, in order
            out = procs[k % workers].stdout
            assert out is not None
            yield from pickle.load(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()


def _worker() -> None:
    """A worker of :func:`_read_in_workers`: reads its chunks of files, answers each with
    their rows."""
    keyring, allow_unverified, chunks = pickle.load(sys.stdin.buffer)
    out = os.fdopen(os.dup(1), "wb")  # the answers' own channel: a stray print goes to stderr
    os.dup2(2, 1)
    for chunk in chunks:
        pickle.dump([read_rows(path, keyring, allow_unverified) for path in chunk], out,
                    protocol=pickle.HIGHEST_PROTOCOL)
        out.flush()


def _run_identity(row: dict[str, Any]) -> tuple[Any, ...]:
    """What a run row says about the file's header: a rewritten file changes it."""
    return (row.get("run"), row.get("created"), row.get("labels"))


def _dicts(cur: duckdb.DuckDBPyConnection) -> list[dict[str, Any]]:
    names = [d[0] for d in cur.description]
    return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]
