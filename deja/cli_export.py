"""``deja export``: a recorded run as OpenTelemetry spans, sent to a tracing backend over
OTLP/HTTP or written as an OTLP/JSON file (the spans are built in :mod:`recorder.otel`)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from deja._common import BadInput, _allow_unverified_option, _fail, _load, _warn_unverified


@click.command()
@click.argument("cassette", type=click.Path(path_type=Path, dir_okay=False))
@click.option("--otlp", "endpoint", metavar="URL",
              help="Send the spans to this OTLP/HTTP traces endpoint, e.g. "
                   "http://127.0.0.1:4318/v1/traces (headers from "
                   "OTEL_EXPORTER_OTLP_TRACES_HEADERS or OTEL_EXPORTER_OTLP_HEADERS).")
@click.option("--format", "fmt", type=click.Choice(["otlp-json"]),
              help="Write the spans to a file (-o) in this format instead: otlp-json is the "
                   "OTLP/JSON encoding of the request --otlp would send.")
@click.option("-o", "--output", type=click.Path(path_type=Path, dir_okay=False, allow_dash=True),
              help="With --format: the file to write ('-' for stdout).")
@click.option("--content", is_flag=True,
              help="Include message content: the prompts, system instructions, replies, and "
                   "tool arguments and results (left out by default).")
@_allow_unverified_option
@click.option("--allow-torn", is_flag=True, help="Export the intact part of a torn cassette.")
@click.option("--timeout", type=click.FloatRange(min=0.1), default=10.0, show_default=True,
              help="With --otlp: seconds to keep trying the endpoint, retries included.")
def export(cassette: Path, endpoint: str | None, fmt: str | None, output: Path | None,
           content: bool, allow_unverified: bool, allow_torn: bool, timeout: float) -> None:
    """Send a run to a tracing backend as OpenTelemetry spans (GenAI conventions).

    One invoke_agent span for the run, a "chat MODEL" span per model call and an
    "execute_tool NAME" span per tool call, with the gen_ai.* attributes (provider,
    models, response id, finish reasons, token usage with cache reads and writes counted
    in gen_ai.usage.input_tokens). Trace and span ids come from the run id, so exporting
    a run again gives the same trace. Message content only with --content.

    deja export CASSETTE --otlp http://127.0.0.1:4318/v1/traces, or
    deja export CASSETTE --format otlp-json -o run.otlp.json. Exit 2 on a bad cassette or
    an endpoint that does not take the spans.
    """
    if (endpoint is None) == (fmt is None):
        raise BadInput("give either --otlp URL or --format otlp-json -o FILE")
    if fmt is not None and output is None:
        raise BadInput("--format otlp-json needs -o FILE (or -o - for stdout)")
    if endpoint is not None and output is not None:
        raise BadInput("-o goes with --format otlp-json; --otlp sends the spans instead")
    loaded = _load(cassette, allow_unverified=allow_unverified, allow_torn=allow_torn)
    _warn_unverified(loaded)

    from recorder import otel
    from recorder.errors import DejaError

    spans = otel.to_spans(loaded, content=content)
    trace = f"{otel.trace_id(loaded.run):032x}"
    if endpoint is not None:
        try:
            otel.send(spans, endpoint, timeout=timeout)
        except DejaError as exc:
            _fail(exc)
        click.echo(f"deja: sent run {loaded.run} ({len(spans)} spans, trace {trace}) to "
                   f"{endpoint}", err=True)
        return
    assert output is not None
    text = otel.to_json(spans) + "\n"
    if str(output) == "-":
        sys.stdout.write(text)
        return
    try:
        output.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise BadInput(f"cannot write {output}: {exc.strerror or exc}") from None
    click.echo(f"deja: wrote run {loaded.run} ({len(spans)} spans, trace {trace}) to {output}",
               err=True)
