"""The README's screenshots of the viewer: docs/viewer-run.png and docs/viewer-diff.png.

    .venv/bin/python docs/make_screenshots.py [--out docs]

Needs Debian's chromium (``make test`` installs it; Playwright never downloads a browser)
and, for the non-ASCII text and emoji of the corpus, Debian's fonts-noto-cjk and
fonts-noto-color-emoji (``apt-get install fonts-noto-cjk fonts-noto-color-emoji``).
Everything is made here, offline, in a temporary directory with a throwaway signing key:
the viewer tests' corpus is recorded against the stub model (``build_corpus`` of
tests/test_viewer_queries.py: a streamed run with thinking, a tool call, non-ASCII text
and an image; the retry-spiral agent and a fork of it with the search result fixed), then
``deja view runs`` serves it and headless Chromium, driven by Playwright as in
tests/test_viewer_browser.py, takes the pictures:

- viewer-run.png: the streamed run, its header and timeline, step 0 opened (the
  conversation: system prompt, the user's message with its image, the thinking and the
  tool call of the reply);
- viewer-diff.png: the fork against its parent, the first divergence opened.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
MAX_BYTES = 300_000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs",
                        help="where the PNG files go (default: docs/)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="deja-shots-") as tmp:
        work = Path(tmp)
        os.environ.update(DEJA_HOME=str(work / "home"), DEJA_KEY="shots-" + secrets.token_hex(16))
        os.environ.pop("DEJA_OLD_KEYS", None)
        # Imported here: the corpus module reads the environment set just above.
        from playwright.sync_api import expect
        from test_viewer_browser import chromium_missing, chromium_page, serve_viewer, shot
        from test_viewer_queries import build_corpus

        missing = chromium_missing()
        if missing:
            sys.stderr.write(missing + "\n")
            return 1
        corpus = build_corpus(work / "corpus")
        args.out.mkdir(parents=True, exist_ok=True)
        rich, spiral, fixed = (corpus.ids[k] for k in ("rich", "spiral", "fixed"))
        with serve_viewer(Path("runs"), work / "view.log", cwd=corpus.project) as base:
            # A tall window, cut below the conversation: the page scrolls inside itself,
            # so a full-page screenshot would stop at the window's height.
            with chromium_page({"width": 1280, "height": 2400}) as page:
                page.goto(f"{base}/?run={rich}&step=0")
                page.screenshot(path=str(work / "warm-up.png"))  # the first can be blank
                expect(page.get_by_text("Step 0: model claude-haiku-4-5")).to_be_visible()
                expect(page.get_by_test_id("stChatMessage").last).to_contain_text("stop: tool_use")
                expect(page.get_by_test_id("stImage")).to_be_visible()
                bottom = page.get_by_test_id("stChatMessage").last.bounding_box()
                assert bottom is not None
                shot(page, args.out / "viewer-run.png",
                     clip={"x": 0, "y": 0, "width": 1280,
                           "height": bottom["y"] + bottom["height"] + 24})
            with chromium_page({"width": 1280, "height": 960}) as page:
                page.goto(f"{base}/?a={spiral}&b={fixed}")
                expect(page.get_by_text("First divergence: step 1", exact=True)).to_be_visible()
                expect(page.get_by_test_id("stExpander").filter(has_text="▶ first divergence")
                       ).to_contain_text("/result")
                shot(page, args.out / "viewer-diff.png")
    for name in ("viewer-run.png", "viewer-diff.png"):
        size = (args.out / name).stat().st_size
        sys.stdout.write(f"{args.out / name}: {size:,} bytes\n")
        if size > MAX_BYTES:
            sys.stderr.write(f"  over {MAX_BYTES:,} bytes: make the viewport smaller\n")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
