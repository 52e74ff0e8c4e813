"""``deja stub``: the stub Anthropic Messages API, from a script or from a recorded run."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import click

from deja._common import BadInput, _allow_unverified_option, _fail, _load, _warn_unverified


def _stub_script_from(cassette: Path, allow_unverified: bool) -> Any:
    """The stub script answering what the run of ``cassette`` received (exit 2 if none)."""
    from recorder.testing.server import StubScriptError, load_script
    from replayer.stub import script_from_cassette

    loaded = _load(cassette, allow_unverified=allow_unverified)
    _warn_unverified(loaded)
    try:
        made = script_from_cassette(loaded)
        load_script(made.script)  # what is written or served must load as it is
    except StubScriptError as exc:
        _fail(exc)
    for why in made.skipped:
        click.echo(f"deja stub: {cassette}: left out {why}", err=True)
    return made


@click.command()
@click.option("--script", type=click.Path(path_type=Path, dir_okay=False, exists=True),
              help="JSON script of turns to answer with.")
@click.option("--from", "from_cassette", type=click.Path(path_type=Path, dir_okay=False),
              metavar="CASSETTE",
              help="Answer what this recorded run received: each model call of the cassette, "
                   "at the same place in the same conversation, with its recorded response.")
@click.option("-o", "--output", type=click.Path(path_type=Path, dir_okay=False),
              help="With --from: write the script to this file and exit instead of serving.")
@_allow_unverified_option
@click.option("--port", type=int, default=8765, show_default=True,
              help="Port on 127.0.0.1 (0 picks a free one).")
@click.option("--ready-file", type=click.Path(path_type=Path, dir_okay=False),
              help="Write the base URL to this file once the server listens.")
def stub(script: Path | None, from_cassette: Path | None, output: Path | None,
         allow_unverified: bool, port: int, ready_file: Path | None) -> None:
    """Serve a stub Anthropic Messages API on 127.0.0.1, answering from a script.

    --script FILE serves a script; --from CASSETTE serves what a recorded run received, and
    --from CASSETTE -o FILE writes that script instead. Point an agent at the server with
    ANTHROPIC_BASE_URL=http://127.0.0.1:PORT. Stop with Ctrl-C.
    """
    import signal
    import threading

    from recorder.testing.server import StubScriptError, StubServer

    if (script is None) == (from_cassette is None):
        raise BadInput("give either --script FILE or --from CASSETTE")
    if output is not None and from_cassette is None:
        raise BadInput("-o/--output writes the script made --from a cassette; add --from "
                       "CASSETTE, or serve a script with --script FILE")
    source: Any = script
    what = str(script)
    if from_cassette is not None:
        made = _stub_script_from(from_cassette, allow_unverified)
        if output is not None:
            tmp = output.with_name(output.name + ".tmp")
            try:
                tmp.write_text(made.text(), encoding="utf-8")
                os.replace(tmp, output)
            except OSError as exc:
                _fail(exc)
            click.echo(f"deja stub: wrote {output}: {len(made.script['rules'])} rules answering "
                       f"{made.calls} model calls of run {made.run}; serve it with deja stub "
                       f"--script {output}", err=True)
            return
        source, what = made.script, f"the model calls of run {made.run} ({from_cassette})"
    try:
        server = StubServer(source, port=port).start()
    except (StubScriptError, OSError) as exc:
        _fail(exc)
    click.echo(f"deja stub: serving {what} at {server.url}", err=True)
    if ready_file is not None:
        tmp = ready_file.with_suffix(".tmp")
        tmp.write_text(server.url)
        os.replace(tmp, ready_file)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
