"""The Gemini function-calling loop recorded in ``v2_gemini_agent.jsonl``.

One run through the google-genai SDK: a ``generateContent`` call with a function
declaration, the ``get_weather`` tool through ``@recorder.tool`` for each function call of
the reply, and the next call with the model's turn and a ``functionResponse`` added; the
second call is streamed (``streamGenerateContent?alt=sse``), the others are not. Three
calls, the last one answering in text; the requests are stored as what each adds to
``contents``.

``agent_changed_prompt`` is the same agent with another user prompt: replaying the golden
cassette with it must diverge. Do not change what ``agent`` sends: the golden cassette was
recorded from it.
"""

from __future__ import annotations

from typing import Any

from google import genai
from google.genai import types

import recorder

MODEL = "gemini-2.5-flash"
PROMPT = "What is the weather in Paris and in Lyon right now?"
CHANGED_PROMPT = "What is the weather in Rome right now?"
ANSWER = "It is 18 degrees and clear in both."
API_KEY = "AIzaSyD-golden-key-not-a-secret-0000000"
WEATHER = types.Tool(function_declarations=[types.FunctionDeclaration(
    name="get_weather", description="Current weather for a city.",
    parameters=types.Schema(type=types.Type.OBJECT,
                            properties={"city": types.Schema(type=types.Type.STRING)},
                            required=["city"]))])
CONFIG = types.GenerateContentConfig(
    tools=[WEATHER], automatic_function_calling=types.AutomaticFunctionCallingConfig(
        disable=True))

# What the stub server answers while make_golden.py records the run.
SCRIPT = {"select": "conversation", "turns": [
    {"text": "Let me look up Paris.",
     "tool_use": {"name": "get_weather", "input": {"city": "Paris"}}},
    {"text": "Now Lyon.", "tool_use": {"name": "get_weather", "input": {"city": "Lyon"}}},
    {"text": ANSWER},
]}


@recorder.tool
def get_weather(city: str) -> dict[str, Any]:
    """The tool: a fixed answer, so that a recording does not depend on the outside world."""
    return {"city": city, "temp_c": 18, "sky": "clear"}


def agent(base_url: str, prompt: str = PROMPT) -> str:
    """Ask, run the functions the model calls, ask again with everything so far; returns
    the final answer's text."""
    client = genai.Client(api_key=API_KEY, http_options=types.HttpOptions(base_url=base_url))
    try:
        contents: list[Any] = [types.Content(role="user", parts=[types.Part(text=prompt)])]
        for turn in range(5):
            if turn == 1:
                parts: list[types.Part] = []
                for chunk in client.models.generate_content_stream(
                        model=MODEL, contents=contents, config=CONFIG):
                    parts += chunk.candidates[0].content.parts or [] \
                        if chunk.candidates and chunk.candidates[0].content else []
                reply = types.Content(role="model", parts=parts)
            else:
                response = client.models.generate_content(model=MODEL, contents=contents,
                                                          config=CONFIG)
                assert response.candidates and response.candidates[0].content
                reply = response.candidates[0].content
            contents.append(reply)
            calls = [p.function_call for p in reply.parts or [] if p.function_call]
            if not calls:
                return "".join(p.text or "" for p in reply.parts or [])
            contents.append(types.Content(role="user", parts=[
                types.Part.from_function_response(name=call.name or "",
                                                  response=get_weather(**(call.args or {})))
                for call in calls]))
        raise AssertionError("no final answer")
    finally:
        client.close()


def agent_changed_prompt(base_url: str) -> str:
    """The same agent with another user prompt: its first request differs."""
    return agent(base_url, prompt=CHANGED_PROMPT)
