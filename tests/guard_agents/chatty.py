"""A recorded agent for the guard tests: it calls the model until the harness stops it.

Run under ``deja record`` with ``ANTHROPIC_BASE_URL`` pointing at a stub. Each call is
``ask(client, i)`` (the tests make the same calls in-process, so requests match).
``CHATTY_TURNS`` caps the calls (default: no cap but the harness); ``CHATTY_KILL_AFTER=n``
kills the process with SIGKILL right after the n-th reply, as a crash would.
"""

from __future__ import annotations

import os
import signal
import sys

import anthropic

import recorder

MODEL = "claude-sonnet-4-6"


def client(base_url: str | None = None) -> anthropic.Anthropic:
    # An explicit timeout keeps the SDK from refusing large max_tokens without streaming.
    return anthropic.Anthropic(base_url=base_url, api_key="sk-stub", max_retries=0,
                               timeout=30)


def ask(c: anthropic.Anthropic, i: int, max_tokens: int = 64) -> anthropic.types.Message:
    return c.messages.create(model=MODEL, max_tokens=max_tokens,
                             messages=[{"role": "user", "content": f"turn {i}"}])


def main() -> int:
    c = client()
    turns = int(os.environ.get("CHATTY_TURNS", "1000000"))
    kill_after = int(os.environ.get("CHATTY_KILL_AFTER", "0"))
    try:
        for i in range(turns):
            ask(c, i)
            print(f"turn {i}", flush=True)
            if kill_after and i + 1 == kill_after:
                os.kill(os.getpid(), signal.SIGKILL)
    except recorder.RunStopped as stop:  # caught: the run still ends with the guard's status
        print(f"stopped: {type(stop).__name__}: {stop}", flush=True)
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
