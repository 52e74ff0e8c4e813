"""What the Gemini tests of the proxy, the viewer and the OTel export share: a config that
declares one function, and the function-calling loop an unmodified google-genai agent runs
by hand."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from google import genai
from google.genai import types

MODEL = "gemini-2.5-flash"


def function_config(name: str, argument: str, description: str,
                    **options: Any) -> types.GenerateContentConfig:
    """A config that declares the function ``name`` of one string ``argument`` (the SDK
    does not call it by itself); ``options``: more of the config (``system_instruction``,
    ``max_output_tokens`` ...)."""
    return types.GenerateContentConfig(
        tools=[types.Tool(function_declarations=[types.FunctionDeclaration(
            name=name, description=description,
            parameters=types.Schema(type=types.Type.OBJECT, properties={
                argument: types.Schema(type=types.Type.STRING)}))])],
        automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True),
        **options)


def function_loop(url: str, api_key: str, prompt: str, config: types.GenerateContentConfig,
                  respond: Callable[[types.FunctionCall], dict[str, Any]], *,
                  stream: bool = False, vertex: bool = False) -> list[list[Any]]:
    """Ask ``prompt`` of the server at ``url``, answer each function call the model asks
    for with ``respond(call)``, until it answers in text; the responses of each turn, as
    the SDK gave them (one, or a stream's chunks)."""
    out: list[list[Any]] = []
    contents: list[Any] = [prompt]
    with genai.Client(api_key=api_key, vertexai=vertex,
                      http_options=types.HttpOptions(base_url=url)) as client:
        while True:
            if stream:
                chunks = list(client.models.generate_content_stream(
                    model=MODEL, contents=contents, config=config))
            else:
                chunks = [client.models.generate_content(model=MODEL, contents=contents,
                                                         config=config)]
            out.append(chunks)
            calls = [call for chunk in chunks for call in chunk.function_calls or []]
            if not calls:
                return out
            contents.append(types.Content(role="model", parts=[
                part for chunk in chunks for part in chunk.candidates[0].content.parts]))
            contents.append(types.Content(role="user", parts=[
                types.Part.from_function_response(name=call.name or "", response=respond(call))
                for call in calls]))


def text_of(turn: list[Any]) -> str:
    """The text of one turn's responses (a stream's chunks joined)."""
    return "".join(chunk.text or "" for chunk in turn)
