"""The floor of the proxy rows: a bare forwarder on ``deja proxy``'s own server stack.

uvicorn on httptools and uvloop with the proxy's header guard
(:func:`recorder.serving.guarded_httptools`), its socket (:func:`recorder.serving.bind`),
its body reader (:func:`recorder.serving.read_body`) and its upstream client (one pooled
``aiohttp.ClientSession``, kept-alive connections, nothing decompressed, no headers of its
own), forwarding each request to ``--upstream`` and its response back: a stream
(``text/event-stream``) chunk by chunk as it arrives, a whole body once complete, as the
proxy passes them. No run, no routing, no cassette, no guards, no log line: what is left
is the extra hop itself in Python, which deja's proxy cannot go below.

``python bench/proxy_forwarder.py --upstream URL --port 0 --ready-file F`` (the proxy's
flags); SIGTERM stops it.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

import aiohttp
import yarl

from recorder.serving import bind, guarded_httptools, read_body, run_until_stopped, write_ready

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

# Headers of one hop (RFC 9110 7.6.1) and those the client sets from the URL and the body.
HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer",
                 b"transfer-encoding", b"upgrade", b"host", b"content-length"})


class Forwarder:
    """An ASGI app that passes every request to ``upstream`` and its response back."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.client: aiohttp.ClientSession | None = None

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    self.client = aiohttp.ClientSession(  # as the proxy's Responder opens it
                        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
                        timeout=aiohttp.ClientTimeout(total=None, sock_connect=30,
                                                      sock_read=600),
                        auto_decompress=False, trust_env=False,
                        skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding",
                                           "Content-Type"))
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    if self.client is not None:
                        await self.client.close()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] == "http":
            await self._forward(scope, receive, send)

    async def _forward(self, scope: Message, receive: Receive, send: Send) -> None:
        named = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        body = await read_body(receive, named, limit=32 * 1024 * 1024, timeout=60)
        query = scope.get("query_string") or b""
        url = self.upstream + scope["path"] + (f"?{query.decode('latin-1')}" if query else "")
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]
                   if k.lower() not in HOP]
        assert self.client is not None
        async with self.client.request(scope["method"], yarl.URL(url, encoded=True),
                                       headers=headers, data=body,
                                       allow_redirects=False) as response:
            out = [(k.lower(), v) for k, v in response.raw_headers if k.lower() not in HOP]
            stream = "event-stream" in response.headers.get("content-type", "")
            if stream:
                await send({"type": "http.response.start", "status": response.status,
                            "headers": out})
                async for chunk in response.content.iter_any():
                    await send({"type": "http.response.body", "body": chunk,
                                "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            whole = b"".join([chunk async for chunk in response.content.iter_any()])
            out.append((b"content-length", str(len(whole)).encode()))
            await send({"type": "http.response.start", "status": response.status,
                        "headers": out})
            await send({"type": "http.response.body", "body": whole, "more_body": False})


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--ready-file", type=Path)
    args = parser.parse_args(argv)
    config = uvicorn.Config(Forwarder(args.upstream), host=args.host, port=args.port,
                            lifespan="on", http=guarded_httptools(), loop="uvloop",
                            log_level="warning", access_log=False, server_header=False,
                            date_header=False, backlog=2048, timeout_keep_alive=30)
    server = uvicorn.Server(config)
    sock = bind(args.host, args.port)

    def listening(port: int) -> None:
        if args.ready_file is not None:
            write_ready(args.ready_file, {"url": f"http://{args.host}:{port}", "port": port,
                                          "pid": os.getpid()})

    run_until_stopped(server, sock, listening=listening)
    return 0


if __name__ == "__main__":
    sys.exit(main())
