"""The recording proxy: ``deja proxy``, an Anthropic-compatible reverse proxy that records
agents written in any language, replays them offline and forks them.

It records like :mod:`recorder` (the same sessions, cassettes, redaction and guards) and
serves like :mod:`replayer`; it sits above both and nothing below imports it.
:mod:`proxy.runs` says which run a request belongs to, :mod:`proxy.app` is the ASGI
application, :mod:`proxy.server` puts a mode together and runs it under uvicorn.
"""

from proxy.app import Proxy
from proxy.runs import ProxyRun, Registry
from proxy.server import ProxyOptions, ServeResult, build, serve

__all__ = ["Proxy", "ProxyOptions", "ProxyRun", "Registry", "ServeResult", "build", "serve"]
