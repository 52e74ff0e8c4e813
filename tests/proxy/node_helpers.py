"""Running the Node.js example agents from the proxy tests.

examples/node-agent drives the official TypeScript SDK ``@anthropic-ai/sdk``;
examples/vercel-agent the Vercel AI SDK (``ai`` with ``@ai-sdk/anthropic``), whose base URL
ends in ``/v1``. :func:`ensure_node_modules` installs an agent's packages from its lockfile
once; :func:`node_agent` runs ``node agent.mjs`` (the official SDK's, or ``agent=``
:data:`VERCEL_AGENT`) with an environment that holds no real credentials; :func:`read_dump`
decodes the file the official SDK agent's ``--dump`` option writes (one line per HTTP
response the SDK received).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
AGENT_DIR = ROOT / "examples" / "node-agent"
AGENT = AGENT_DIR / "agent.mjs"
VERCEL_DIR = ROOT / "examples" / "vercel-agent"
VERCEL_AGENT = VERCEL_DIR / "agent.mjs"

# What agent.mjs prints for examples/node-agent/stub.json, and for the same run with a
# weather tool result that mentions snow.
STUB_SCRIPT = AGENT_DIR / "stub.json"
STUB_ANSWER = "It is 18°C (64.4°F) with light rain in Paris: take an umbrella."
SNOW_ANSWER = "Snow in Paris today: stay in, or wear boots and a warm coat."

# Exit code of agent.mjs when an API or connection error reached the SDK.
API_ERROR_EXIT = 2

# Variables of the caller's environment never passed on to the agent.
_SCRUBBED_PREFIXES = ("ANTHROPIC_", "DEJA_RUN")


def node_missing() -> str | None:
    """Why the agent cannot run here (no ``node`` or ``npm`` on PATH), or ``None``."""
    missing = [tool for tool in ("node", "npm") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not on PATH (make node installs them)"
    return None


def ensure_node_modules(directory: Path = AGENT_DIR) -> None:
    """Install the dependencies of the agent in ``directory`` from its lockfile, unless
    every package its ``package.json`` names is there already."""
    wanted = json.loads((directory / "package.json").read_text(encoding="utf-8"))
    if all((directory / "node_modules" / name / "package.json").is_file()
           for name in wanted.get("dependencies", {})):
        return
    subprocess.run(
        ["npm", "ci", "--no-audit", "--no-fund"],
        cwd=directory,
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    )


def agent_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The caller's environment for an agent: every ``ANTHROPIC_*`` variable and
    ``DEJA_RUN`` taken out, ``ANTHROPIC_API_KEY=sk-test`` put in, ``env`` laid over it."""
    run_env = {
        key: value for key, value in os.environ.items() if not key.startswith(_SCRUBBED_PREFIXES)
    }
    run_env["ANTHROPIC_API_KEY"] = "sk-test"
    run_env.update(env or {})
    return run_env


def node_agent(
    *args: str,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    timeout: float = 120,
    agent: Path = AGENT,
) -> subprocess.CompletedProcess[str]:
    """Run ``node examples/node-agent/agent.mjs ARGS...`` (or the ``agent`` given) and
    return what it did.

    ``env`` is laid over the caller's environment with every ``ANTHROPIC_*`` variable and
    ``DEJA_RUN`` taken out and ``ANTHROPIC_API_KEY=sk-test`` put in; pass
    ``ANTHROPIC_BASE_URL`` (the stub's or the proxy's URL) and, to tag the run, ``DEJA_RUN``.
    ``cwd`` (default: the agent's folder) is where a relative ``--dump FILE`` lands. Output is
    text; the exit code is not checked (0: answered, 2: an API or connection error).
    """
    return subprocess.run(
        ["node", str(agent), *args],
        cwd=cwd if cwd is not None else agent.parent,
        env=agent_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def read_dump(path: str | os.PathLike[str]) -> list[dict]:
    """The lines of an ``agent.mjs --dump`` file, each with its body decoded into ``body``.

    Each line has ``attempt`` (1, 2, ... over the whole run), ``retry_count`` (the SDK's
    ``x-stainless-retry-count`` for that request), ``status`` (``None`` when no response
    came), ``body`` (bytes) and, when the body broke off or no response came, ``error``.
    """
    lines = []
    with open(path, encoding="utf-8") as fh:
        for raw in fh:
            line = json.loads(raw)
            line["body"] = base64.b64decode(line.pop("body_b64"))
            lines.append(line)
    return lines
