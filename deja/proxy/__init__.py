"""The recording proxy: ``deja proxy``, an Anthropic-compatible reverse proxy that records
agents written in any language, replays them offline and forks them.

It records like :mod:`recorder` (the same sessions, cassettes, redaction and guards) and
serves like :mod:`replayer`; it sits above both and nothing below imports it.
:mod:`deja.proxy.runs` says which run a request belongs to, :mod:`deja.proxy.app` is the ASGI
application, :mod:`deja.proxy.server` puts a mode together and runs it under uvicorn.
"""

from deja.proxy.app import Proxy
from deja.proxy.runs import ProxyRun, Registry
from deja.proxy.server import ProxyOptions, ServeResult, build, serve

__all__ = ["Proxy", "ProxyOptions", "ProxyRun", "Registry", "ServeResult", "build", "serve"]
