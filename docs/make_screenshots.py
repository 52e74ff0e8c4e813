"""The README's screenshots of the viewer, 1400 px wide: docs/viewer-run.png,
viewer-step.png, viewer-diff.png, viewer-fork.png and viewer-submitted.png.

    .venv/bin/python docs/make_screenshots.py [--out docs]

Needs Debian's chromium (``make test`` installs it; Playwright never downloads a browser)
and, for the non-ASCII text and emoji of the corpus, Debian's fonts-noto-cjk and
fonts-noto-color-emoji (``apt-get install fonts-noto-cjk fonts-noto-color-emoji``).
Everything is made here, offline, in a temporary directory with a throwaway signing key:
the viewer tests' corpus is recorded against the stub model (``build_corpus`` of
tests/viewer/test_viewer_queries.py: a streamed run with thinking, a tool call, non-ASCII text
and an image; the retry-spiral agent and a fork of it with the search result fixed), then
``deja view runs`` serves it and headless Chromium, driven by Playwright as in
tests/viewer/test_viewer_browser.py (which runs this script), takes the pictures:

- viewer-run.png: the streamed run: its header, timeline, cumulative tokens and cost and
  the waterfall of its steps;
- viewer-step.png: its step 0 opened as a conversation: system prompt, the user's
  message with its image, the thinking and the tool call of the reply;
- viewer-diff.png: the fork against its parent, the first divergence opened;
- viewer-fork.png: the spiral's tool step forked with a fixed search result against the
  stub model, the fork finished, the edit kept for another try;
- viewer-submitted.png: the Submitted runs page over a runs database of this temporary
  home, two runs submitted and run by a real ``deja worker``: one waits for an answer
  (its question and the answer box), one completed; each run's id opens its page.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests" / "viewer"), str(ROOT / "tests")]  # its corpus, and conftest
MAX_BYTES = 400_000
WIDTH = 1400
NAMES = ("viewer-run.png", "viewer-step.png", "viewer-diff.png", "viewer-fork.png",
         "viewer-submitted.png")


def _box(locator: Any) -> dict[str, float]:
    box = locator.bounding_box()
    assert box is not None, locator
    return box


def _clip(top: float, bottom: float) -> dict[str, float]:
    return {"x": 0, "y": max(0.0, top), "width": WIDTH, "height": bottom - max(0.0, top)}


@contextmanager
def submitted_runs(work: Path) -> Iterator[list[str]]:
    """Two runs submitted to the runs database of ``$DEJA_HOME`` and run by a real
    ``deja worker`` (as tests/viewer/test_viewer_runs.py makes them): one completed, one
    waiting for an answer; their ids, while the worker is up."""
    from test_viewer_runs import ASK_AGENT, REPORT_AGENT, wait_status, worker

    from deja.runs import config, engine
    from deja.runs.service import Runs
    from deja.runs.store import Store
    from viewer import submitted

    project = work / "submitted"
    project.mkdir()
    (project / "ask_agent.py").write_text(ASK_AGENT)
    (project / "report_agent.py").write_text(REPORT_AGENT)
    url = config.database_url()
    runs = Runs(Store(url), engine.Client(url))
    log = work / "worker.log"
    try:
        with worker(log):
            made = []
            for agent, status in (("report_agent.py", "completed"),
                                  ("ask_agent.py", "input_required")):
                made.append(runs.submit({"command": [sys.executable, agent],
                                         "cwd": str(project),
                                         "labels": {"team": "billing"}})["run_id"])
                wait_status(runs, made[-1], status, log)
            yield made
    finally:
        submitted.close(runs)


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
        from test_viewer_browser import (
            button,
            chromium_missing,
            chromium_page,
            serve_viewer,
            shot,
            sign_in,
        )
        from test_viewer_queries import AFTER_FORK, GOOD, build_corpus
        from test_viewer_runs import QUESTION

        from recorder.testing.server import StubServer

        missing = chromium_missing()
        if missing:
            sys.stderr.write(missing + "\n")
            return 1
        corpus = build_corpus(work / "corpus")
        args.out.mkdir(parents=True, exist_ok=True)
        rich, spiral, fixed = (corpus.ids[k] for k in ("rich", "spiral", "fixed"))
        out = {name: args.out / name for name in NAMES}
        with serve_viewer(Path("runs"), work / "view.log", cwd=corpus.project) as base, \
                StubServer(AFTER_FORK) as model:
            # A tall window: the page scrolls inside itself, so a full-page screenshot
            # would stop at the window's height; each picture is a clip of it.
            with chromium_page({"width": WIDTH, "height": 2600}) as page:
                sign_in(page, base)  # the address deja view printed: its cookie
                page.goto(f"{base}/?run={rich}&file=rich.jsonl")
                page.screenshot(path=str(work / "warm-up.png"))  # the first can be blank
                expect(page.get_by_test_id("stVegaLiteChart")).to_have_count(3)
                drawn = page.get_by_test_id("stVegaLiteChart").last.locator("canvas, svg")
                expect(drawn.first).to_be_visible()
                shot(page, work / "settle.png")  # every chart drawn at its final size
                waterfall = _box(page.get_by_test_id("stVegaLiteChart").last)
                shot(page, out["viewer-run.png"],
                     clip=_clip(0, waterfall["y"] + waterfall["height"] + 24))

                page.goto(f"{base}/?run={rich}&file=rich.jsonl&step=0")
                expect(page.get_by_text("Step 0: model claude-haiku-4-5")).to_be_visible()
                expect(page.get_by_test_id("stChatMessage").last).to_contain_text("stop: tool_use")
                expect(page.get_by_test_id("stImage")).to_be_visible()
                top = _box(page.get_by_role("heading", name="Step 0: model claude-haiku-4-5"))
                bottom = _box(page.get_by_test_id("stChatMessage").last)
                shot(page, out["viewer-step.png"],
                     clip=_clip(top["y"] - 24, bottom["y"] + bottom["height"] + 24))
            with chromium_page({"width": WIDTH, "height": 4000}) as page:
                sign_in(page, base)
                page.goto(f"{base}/?run={spiral}&file=spiral.jsonl&step=1")
                editor = page.get_by_label("Edited document (JSON)")
                editor.fill(json.dumps({"result": GOOD}))
                editor.press("Control+Enter")
                expect(page.get_by_text("The edit is valid.")).to_be_visible()
                target = page.get_by_label(re.compile("^Live target"))
                target.fill(model.url)
                target.press("Enter")
                expect(target).to_have_value(model.url)
                button(page, "Fork").click()
                expect(page.get_by_text(re.compile(r"Fork of step 1 finished: run r_\w+"))
                       ).to_be_visible(timeout=90_000)
                expect(editor).to_have_value(json.dumps({"result": GOOD}))
                # From the step picker (the finished fork is listed under it) to the button.
                top = _box(page.get_by_text("Open step", exact=True))
                bottom = _box(button(page, "Fork"))
                shot(page, out["viewer-fork.png"],
                     clip=_clip(top["y"] - 24, bottom["y"] + bottom["height"] + 24))
            with chromium_page({"width": WIDTH, "height": 1000}) as page:
                sign_in(page, base)
                page.goto(f"{base}/?a={spiral}&a_file=spiral.jsonl&b={fixed}&b_file=fixed.jsonl")
                expect(page.get_by_text("First divergence: step 1", exact=True)).to_be_visible()
                expect(page.get_by_test_id("stExpander").filter(has_text="▶ first divergence")
                       ).to_contain_text("/result")
                shot(page, out["viewer-diff.png"])
            with submitted_runs(work) as run_ids, chromium_page({"width": WIDTH,
                                                                   "height": 900}) as page:
                sign_in(page, base)
                page.goto(f"{base}/?page=submitted")
                expect(page.get_by_text(QUESTION)).to_be_visible()
                for run in run_ids:
                    expect(page.get_by_test_id("stDataFrame").locator("table")
                           .filter(has_text=run)).to_have_count(1)
                bottom = _box(page.get_by_text("No schedule;"))
                shot(page, out["viewer-submitted.png"],
                     clip=_clip(0, bottom["y"] + bottom["height"] + 24))
    for name, path in out.items():
        size = path.stat().st_size
        sys.stdout.write(f"{path}: {size:,} bytes\n")
        if size > MAX_BYTES:
            sys.stderr.write(f"  {name} is over {MAX_BYTES:,} bytes: make the clip smaller\n")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
