"""A stub of the Anthropic Messages API (and of OpenAI's and Gemini's) for tests,
benchmarks and the demo.

A test fake, in the manner of ``click.testing``: it is not part of the recorder, and it
imports nothing else from deja (an independent implementation of the wire format is a
better witness for the code under test than a copy of it). :class:`StubServer` serves a
script (:mod:`.script`) on 127.0.0.1; :mod:`.match` picks the answer from the request
alone; :mod:`.reply` builds what is sent (:mod:`.openai_reply` and :mod:`.gemini_reply`
in those formats), and :mod:`.events` writes and reads the event streams.
"""

from recorder.testing.script import StubScriptError, load_script
from recorder.testing.server import StubServer

__all__ = ["StubScriptError", "StubServer", "load_script"]
