"""The viewer's server: the page script (:mod:`viewer.app`) behind :class:`HostGuard`.

``deja view`` runs ``streamlit run viewer/serve.py``; Streamlit finds the ``app`` below
(an ``st.App``, Streamlit's ASGI entry point) and serves it with its own server, with
every HTTP request and websocket handshake passing :class:`viewer.guard.HostGuard` first.
The guard wants the token ``deja view`` printed in its address: ``$DEJA_VIEW_TOKEN``,
which ``deja view`` sets, else ``DEJA_TOKEN``, else this install's (:mod:`deja.runs.auth`).
"""

from __future__ import annotations

import os
from pathlib import Path

from starlette.middleware import Middleware
from streamlit.starlette import App

from deja.runs.auth import server_token
from viewer.guard import TOKEN_ENV, HostGuard

SCRIPT = Path(__file__).resolve().with_name("app.py")

# Taken out of the environment, so the commands a Fork starts do not inherit it.
TOKEN = os.environ.pop(TOKEN_ENV, "") or server_token(os.environ.get("DEJA_TOKEN"))
app = App(SCRIPT, middleware=[Middleware(HostGuard, token=TOKEN)])
