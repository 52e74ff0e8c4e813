"""The viewer's server: the page script (:mod:`viewer.app`) behind :class:`HostGuard`.

``deja view`` runs ``streamlit run viewer/serve.py``; Streamlit finds the ``app`` below
(an ``st.App``, Streamlit's ASGI entry point) and serves it with its own server, with
every HTTP request and websocket handshake passing :class:`viewer.guard.HostGuard` first.
"""

from __future__ import annotations

from pathlib import Path

from starlette.middleware import Middleware
from streamlit.starlette import App

from viewer.guard import HostGuard

SCRIPT = Path(__file__).resolve().with_name("app.py")

app = App(SCRIPT, middleware=[Middleware(HostGuard)])
