"""``deja stub``: the stub model API (Anthropic Messages, OpenAI Chat Completions and
Responses, Gemini ``generateContent``), from a script or from a recorded run.

A script made ``--from`` a cassette answers its Anthropic Messages calls by
:func:`replayer.stub.script_from_cassette`, and its OpenAI and Gemini calls here, by the
same rule: each call becomes a rule that answers its place in its conversation
(``position`` and ``first_user``, then ``last_user`` when two requests differ there) with
what the run received, the attempts of one request a retry sequence. Such a rule also
names its ``endpoint`` and whether the request asks for a ``stream`` (one conversation may
be asked both ways, and the reply of one is no answer to the other), and a Responses
request that continues a response names it (``previous_response_id``: the recorded reply
is served with its id, so the agent continues it again). A JSON reply is kept as
``message``, a stream verbatim as ``sse``, an error with its status, type, message and
retry headers, a call that got no response as ``drop``. These rules come first: they hold
only for their endpoint.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import click

from deja._common import BadInput, _allow_unverified_option, _fail, _load, _warn_unverified

# The endpoints a stub answers besides the Messages API, by the provider of a recorded
# call and the end of its URL's path.
OPENAI_ENDPOINTS = ("/v1/chat/completions", "/v1/responses")
GEMINI_ENDPOINTS = (":generateContent", ":streamGenerateContent")
_ENDPOINTS = {"openai": OPENAI_ENDPOINTS, "gemini": GEMINI_ENDPOINTS}


def _endpoint_of(obs: Mapping[str, Any]) -> str | None:
    """The OpenAI or Gemini endpoint of a recorded model call (None: neither)."""
    path = urlsplit(str(obs.get("url") or "")).path.rstrip("/")
    ends = _ENDPOINTS.get(str(obs.get("provider")), ())
    return next((e for e in ends if path.endswith(e)), None)


def _endpoint_rules(cassette: Any) -> tuple[list[dict[str, Any]], int, dict[int, str]]:
    """The rules answering the OpenAI and Gemini calls of ``cassette``, how many calls
    they answer, and those calls left out, by step, with why. Each answer is what the
    call received, read through its provider (:func:`replayer.stub.recorded_turn`)."""
    from recorder.cassette.schema import Kind
    from recorder.testing.match import first_user_text, last_user_text, position, streams
    from replayer.stub import recorded_turn, retry_chain

    # place -> request fingerprint -> (last user text, [(seq, turn)])
    places: dict[tuple[Any, ...], dict[str, tuple[str, list[tuple[int, dict[str, Any]]]]]] = {}
    skipped: dict[int, str] = {}
    calls = 0
    for obs in cassette.observations:
        endpoint = _endpoint_of(obs) if obs.get("kind") == Kind.MODEL else None
        if endpoint is None:
            continue
        seq = obs["seq"]
        body = cassette.request_of(seq)
        if not isinstance(body, dict):
            skipped[seq] = f"seq {seq}: its request is not a JSON object"
            continue
        turn, why = recorded_turn(obs, body)
        if turn is None:
            skipped[seq] = f"seq {seq}: {why}"
            continue
        calls += 1
        previous = body.get("previous_response_id")
        place = (endpoint, streams(body, endpoint),
                 previous if isinstance(previous, str) else None,
                 first_user_text(body), position(body))
        requests = places.setdefault(place, {})
        _, answers = requests.setdefault(str(obs.get("fp")), (last_user_text(body), []))
        answers.append((seq, turn))
    continued: list[dict[str, Any]] = []  # rules naming a previous response: they go first
    fresh: list[dict[str, Any]] = []
    for (endpoint, stream, previous, first_user, at), requests in places.items():
        when: dict[str, Any] = {"endpoint": endpoint, "stream": stream, "position": at,
                                "first_user": first_user}
        if previous is not None:
            when["previous_response_id"] = previous
        into = fresh if previous is None else continued
        distinct = list(requests.values())
        if len(distinct) > 1:
            seen: set[str] = set()
            for last_user, answers in distinct:
                if last_user in seen:
                    continue  # told apart by nothing the rules look at: the first answers
                seen.add(last_user)
                into.append({"when": {**when, "last_user": last_user}, **retry_chain(answers)})
        into.append({"when": when, **retry_chain(distinct[0][1])})
    return continued + fresh, calls, skipped


def _script_from(cassette: Any) -> Any:
    """The stub script answering the Anthropic, OpenAI and Gemini calls of a loaded
    cassette."""
    from recorder.cassette.schema import Kind
    from recorder.testing.server import StubScriptError
    from replayer.stub import CassetteScript, script_from_cassette

    rules, calls, skipped = _endpoint_rules(cassette)
    other_seqs = {obs["seq"] for obs in cassette.observations
                   if obs.get("kind") == Kind.MODEL and _endpoint_of(obs) is not None}
    try:
        made = script_from_cassette(cassette)
    except StubScriptError as exc:
        if not rules:
            _refuse_plugins(cassette)
            reasons = "; ".join(skipped.values())
            raise StubScriptError(
                f"{cassette.path}: run {cassette.run} holds no model call a stub can answer: "
                "no Anthropic Messages call (POST /v1/messages), OpenAI Chat Completions "
                "or Responses call (POST /v1/chat/completions, /v1/responses) nor Gemini "
                "call (POST .../models/MODEL:generateContent)"
                + (f" ({reasons})" if reasons else "")
                + "; record the agent against one of those APIs to make a stub of it"
            ) from exc
        made = CassetteScript(
            script={"_note": f"Generated by deja stub --from {cassette.path.name} (run "
                             f"{cassette.run}): each rule answers a place in a conversation "
                             "with what the run received there; _seq names the cassette "
                             "steps.",
                    "select": "conversation", "rules": []},
            run=cassette.run, calls=0,
            skipped=tuple(f"seq {o['seq']}: {o.get('url')} (no Anthropic Messages call of the "
                          "run can be answered)" for o in cassette.observations
                          if o.get("kind") == Kind.MODEL and o["seq"] not in other_seqs))
    # the Anthropic side leaves every OpenAI and Gemini call out: those are said here, once
    others = tuple(why for why in made.skipped
                   if not any(why.startswith(f"seq {seq}: ") for seq in other_seqs))
    return CassetteScript(
        script={**made.script, "rules": [*rules, *made.script["rules"]]}, run=made.run,
        calls=made.calls + calls, skipped=(*others, *skipped.values()))


def _refuse_plugins(cassette: Any) -> None:
    """Raise when the run's model calls are a provider the stub does not speak (a plugin):
    naming it, and what serves such a run back instead."""
    from recorder.cassette.schema import Kind
    from recorder.testing.server import StubScriptError
    from replayer.stub import STUB_PROVIDERS

    others = sorted({str(obs.get("provider")) for obs in cassette.observations
                     if obs.get("kind") == Kind.MODEL and obs.get("provider")
                     and obs.get("provider") not in STUB_PROVIDERS})
    if others:
        named = ", ".join(repr(name) for name in others)
        raise StubScriptError(
            f"{cassette.path}: run {cassette.run}'s model calls are provider {named}, which "
            "the stub does not speak (it answers the Anthropic Messages API, Bedrock, OpenAI "
            f"and Gemini); serve this run back with `deja proxy --replay {cassette.path}`")


def _stub_script_from(cassette: Path, allow_unverified: bool) -> Any:
    """The stub script answering what the run of ``cassette`` received (exit 2 if none)."""
    from recorder.testing.server import StubScriptError, load_script

    loaded = _load(cassette, allow_unverified=allow_unverified)
    _warn_unverified(loaded)
    try:
        made = _script_from(loaded)
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
    """Serve a stub model API on 127.0.0.1 (Anthropic Messages, Claude on Bedrock, OpenAI
    Chat Completions and Responses, Gemini generateContent), answering from a script.

    --script FILE serves a script; --from CASSETTE serves what a recorded run received, and
    --from CASSETTE -o FILE writes that script instead. Point an agent at the server with
    ANTHROPIC_BASE_URL=http://127.0.0.1:PORT (OPENAI_BASE_URL=http://127.0.0.1:PORT/v1; a
    google-genai client with http_options base_url http://127.0.0.1:PORT). Stop with Ctrl-C.
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
        while not stop.wait(0.5):  # a timed wait: its handler runs even for a signal that
            pass  # landed just before a wait began, which nothing would wake
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
