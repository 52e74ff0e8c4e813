"""Runs out of the request cycle on the command line: ``deja worker`` (and, beside it,
``deja serve``, ``submit``, ``runs``, ``answer``, ``schedule`` and ``check``)."""

from __future__ import annotations

import click

from deja._common import _fail


@click.command()
@click.option("--id", "worker_id", metavar="NAME",
              help="This worker's id: unique per worker, the same across its restarts "
                   "(default: HOSTNAME-1).")
@click.option("--db", "db", metavar="URL",
              help="The runs database (default: DEJA_DATABASE_URL, else the embedded SQLite "
                   "file under $DEJA_HOME).")
@click.option("-j", "--jobs", type=click.IntRange(min=1), default=1, show_default=True,
              help="Runs at a time.")
def worker(worker_id: str | None, db: str | None, jobs: int) -> None:
    """Take submitted runs from the queue and run each under the harness, durably.

    A run whose worker died is dispatched again and resumed from its cassette (recorded
    turns replay; nothing is paid twice). Stop with SIGTERM or Ctrl-C: runs in flight
    are picked up again by the next worker with this id, or by a live peer.
    """
    from recorder.errors import DejaError
    from runs import worker as runs_worker

    try:
        runs_worker.serve(worker_id or runs_worker.default_worker_id(), db, jobs)
    except DejaError as exc:
        _fail(exc)
