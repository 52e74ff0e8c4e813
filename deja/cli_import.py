"""``deja import``: a vcrpy cassette of model calls, as a signed deja cassette."""

from __future__ import annotations

from pathlib import Path

import click

from deja._common import BadInput, _fail, _labels


@click.command(name="import")
@click.argument("cassette", type=click.Path(path_type=Path, exists=True, dir_okay=False))
@click.option("-o", "--output", "output", type=click.Path(path_type=Path), required=True,
              help="Cassette file to write, or a directory to create <run id>.jsonl in.")
@click.option("--label", "labels", multiple=True, metavar="KEY=VALUE",
              help="Label the run (repeatable).")
@click.option("--force", is_flag=True, help="Overwrite the output file if it exists.")
def import_(cassette: Path, output: Path, labels: tuple[str, ...], force: bool) -> None:
    """Import a vcrpy YAML cassette: deja import CASSETTE.yaml -o RUN.jsonl

    Each interaction is written as a recording writes a live exchange: Anthropic and
    OpenAI calls become model steps with usage, cost and stop reason, other requests HTTP
    steps; API keys and other secrets are redacted by the same rules ([tool.deja.redact]
    included). The result is signed and replays bit for bit (deja replay RUN.jsonl --
    python agent.py, or replayer.replay in a test). vcrpy keeps no timings: a step's time
    is its response's date header, its duration is left empty.
    """
    from recorder.cassette.schema import run_file
    from recorder.errors import DejaError
    from recorder.launch import new_run_id
    from recorder.vcr_import import import_vcr

    label_map = _labels(labels)
    run_id = new_run_id()
    try:
        path = run_file(output, run_id)
    except DejaError as exc:
        _fail(exc)
    if path.exists() and not force:
        raise BadInput(f"{path} already exists; pass --force to overwrite it or choose "
                       "another -o")
    try:
        result = import_vcr(cassette, path, labels=label_map, overwrite=force,
                            run_id=run_id)
    except DejaError as exc:
        _fail(exc)
    http = f", {_count(result.http_calls, 'HTTP call')}" if result.http_calls else ""
    click.echo(f"deja: imported {_count(result.interactions, 'interaction')} "
               f"({_count(result.model_calls, 'model call')}{http}) from {cassette} into "
               f"{result.path} (run {result.run_id})")


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"
