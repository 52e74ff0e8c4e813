"""A cassette's text, written so that a terminal shows it and does not act on it.

A recorded prompt, a tool's result or a web page an agent fetched is data, and deja's
reports print it (a divergence's diff, ``deja diff``, a fork's document). Some characters
are instructions to a terminal rather than text: the C0 controls (ESC begins a sequence
that sets colours, a window's title or a hyperlink; a carriage return writes over a
line), DEL, the C1 controls (``U+009B`` is the one-character form of ESC ``[``), and the
bidirectional overrides and isolates, which reorder what follows them on screen so that a
diff can show a change that is not the one made. Each is written as its escape instead;
tab and newline are kept.
"""

from __future__ import annotations

import re

__all__ = ["visible", "visible_json"]

_ACTS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
# what json.dumps(..., ensure_ascii=False) leaves as it is: it escapes the C0 controls
_ACTS_IN_JSON = re.compile("[\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def visible(text: str) -> str:
    """``text`` with each character a terminal would act on written as its Python escape
    (``\\x1b``, ``\\u202e``)."""
    return _ACTS.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


def visible_json(text: str) -> str:
    """JSON text written with ``ensure_ascii=False``, with DEL, the C1 controls and the
    bidirectional controls as JSON escapes (``\\u009b``): still JSON, of the same value."""
    return _ACTS_IN_JSON.sub(lambda m: f"\\u{ord(m.group()):04x}", text)
