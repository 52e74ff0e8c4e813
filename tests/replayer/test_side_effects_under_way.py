"""A side effect under way when a run was cut is never run again by a fork or a resume.

Two side-effecting tools and a plain one run side by side (``asyncio.gather``), so their
lines interleave: one side effect's intent, the other's intent and outcome, the first's
outcome. Real processes, a real ledger file, the real CLI:

- a fork at a step recorded while ``pay`` was under way (its intent before the step, its
  outcome after it) is refused before anything runs: the fork's prefix would hold the
  intent alone, and a fork neither runs such a call again nor guesses whether it took
  effect (it used to settle it under the fork's own key, which no system had seen, and
  run it: the payment was made twice);
- a run killed inside ``pay`` after ``notify`` finished beside it resumes with ``pay``
  settled and ``notify`` served from its outcome (the resume used to go live when it
  settled ``pay``, and sent the email again); ``pay``'s body, run again, makes its own
  call live while the rest of the log is still served;
- a fork whose prefix would hold an intent with no outcome at all (the program moved on
  from a cancelled call) is refused the same way, and a replay-then-live that meets one
  stops there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from recorder.cassette import load

AGENT = """\
import asyncio, json, os, signal

import recorder
from recorder import Settled

LEDGER = os.environ["LEDGER"]


def by_key(intent):
    with open(LEDGER) as f:
        keys = [json.loads(line)["key"] for line in f if line.strip()]
    if intent.key in keys:
        return Settled.done({"ok": True, "key": intent.key})
    return Settled.not_done()


def write(what, key):
    with open(LEDGER, "a") as f:
        f.write(json.dumps({"what": what, "key": key, "mode": recorder.mode()}) + "\\n")


@recorder.tool
async def rate(invoice):
    return {"invoice": invoice, "rate": 1.0}


@recorder.tool(side_effect=True, settle=by_key)
async def pay(invoice, idempotency_key=None):
    await rate(invoice)  # a call of its own: made live when a resume runs the body again
    await asyncio.sleep(float(os.environ.get("PAY_WAIT", "0.3")))
    if os.environ.get("CRASH") == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    write(f"pay {invoice}", idempotency_key)
    return {"ok": True, "key": idempotency_key}


@recorder.tool(side_effect=True, settle=by_key)
async def notify(email, idempotency_key=None):
    write(f"email {email}", idempotency_key)
    return {"ok": True, "key": idempotency_key}


@recorder.tool
async def search(q):
    return {"q": q, "hits": 1}


async def main():
    if os.environ.get("CANCEL") == "1":  # the program gives up on pay, which goes on
        try:
            await asyncio.wait_for(pay("INV-7"), 0.05)
        except asyncio.TimeoutError:
            print("pay timed out", flush=True)
        print(await search("after"), flush=True)
        return
    print(await asyncio.gather(pay("INV-7"), notify("a@example.com"), search("q")), flush=True)


asyncio.run(main())
"""


def deja(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "deja", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def project(tmp_path: Path) -> tuple[Path, dict[str, str], Path]:
    (tmp_path / "agent.py").write_text(AGENT)
    ledger = tmp_path / "ledger.jsonl"
    ledger.touch()
    return tmp_path, {**os.environ, "LEDGER": str(ledger)}, ledger


def _ledger(ledger: Path) -> list[dict[str, str]]:
    return [json.loads(line) for line in ledger.read_text().splitlines()]


def _lines(path: Path) -> list[tuple[str, str | None]]:
    return [(o["kind"], o.get("name")) for o in load(path).observations]


def test_a_fork_inside_a_side_effect_under_way_is_refused_before_anything_runs(
        project: tuple[Path, dict[str, str], Path]) -> None:
    root, env, ledger = project
    done = deja("record", "--no-loop-guard", "-o", "run.jsonl", "--", sys.executable,
                "agent.py", cwd=root, env=env)
    assert done.returncode == 0, done.stderr
    lines = _lines(root / "run.jsonl")
    pay_intent = lines.index(("intent", "pay"))
    pay_outcome = next(o["seq"] for o in load(root / "run.jsonl").observations
                       if o["kind"] == "outcome" and o["intent"] == pay_intent)
    inside = [seq for seq in range(pay_intent + 1, pay_outcome)
              if lines[seq] == ("tool", "search")]
    assert inside, lines  # search's line landed while pay was under way
    paid = _ledger(ledger)
    assert [e["what"] for e in paid].count("pay INV-7") == 1

    forked = deja("fork", "run.jsonl", "--at", str(inside[0]), "--set",
                  'result={"q": "q", "hits": 0}', "-o", "fork.jsonl", "--", sys.executable,
                  "agent.py", cwd=root, env=env)
    assert forked.returncode != 0, forked.stdout + forked.stderr
    said = forked.stderr
    assert f"step {inside[0]} was recorded while side-effecting tool 'pay'" in said, said
    assert f"intent at step {pay_intent}" in said and f"outcome at step {pay_outcome}" in said
    assert not (root / "fork.jsonl").exists()
    assert _ledger(ledger) == paid  # nothing ran


def test_a_resume_settles_the_side_effect_it_was_killed_in_and_serves_the_one_that_finished(
        project: tuple[Path, dict[str, str], Path]) -> None:
    root, env, ledger = project
    crashed = deja("record", "--no-loop-guard", "-o", "run.jsonl", "--", sys.executable,
                   "agent.py", cwd=root, env={**env, "CRASH": "1"})
    assert crashed.returncode != 0
    lines = _lines(root / "run.jsonl")
    assert ("intent", "pay") in lines and ("intent", "notify") in lines, lines
    before = _ledger(ledger)
    assert [e["what"] for e in before] == ["email a@example.com"]  # pay was killed first

    resumed = deja("resume", "run.jsonl", "--", sys.executable, "agent.py", cwd=root, env=env)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    after = _ledger(ledger)
    emails = [e for e in after if e["what"].startswith("email")]
    assert emails == before, after  # served from its outcome, never sent again
    pays = [e for e in after if e["what"] == "pay INV-7"]
    assert len(pays) == 1 and pays[0]["mode"] == "resume", after  # settled: not done, run
    assert pays[0]["key"].endswith(f":{lines.index(('intent', 'pay'))}")  # the intent's key
    end = load(root / "run.jsonl").end
    assert end is not None and end["status"] == "completed", end


def test_a_fork_after_a_side_effect_with_no_outcome_is_refused(
        project: tuple[Path, dict[str, str], Path]) -> None:
    root, env, ledger = project
    done = deja("record", "-o", "run.jsonl", "--", sys.executable, "agent.py", cwd=root,
                env={**env, "CANCEL": "1", "PAY_WAIT": "0.3"})
    assert done.returncode == 0, done.stderr
    assert "pay timed out" in done.stdout
    lines = _lines(root / "run.jsonl")
    search = lines.index(("tool", "search"))
    assert ("intent", "pay") in lines[:search]
    paid = _ledger(ledger)
    forked = deja("fork", "run.jsonl", "--at", str(search), "--set",
                  'result={"q": "after", "hits": 0}', "-o", "fork.jsonl", "--",
                  sys.executable, "agent.py", cwd=root, env={**env, "CANCEL": "1"})
    assert forked.returncode != 0, forked.stdout + forked.stderr
    assert "side-effecting tool 'pay'" in forked.stderr and "no outcome" in forked.stderr
    assert _ledger(ledger) == paid  # nothing paid again


def test_a_replay_then_live_that_meets_a_side_effect_with_no_outcome_stops_for_a_person(
        project: tuple[Path, dict[str, str], Path]) -> None:
    root, env, ledger = project
    done = deja("record", "-o", "run.jsonl", "--", sys.executable, "agent.py", cwd=root,
                env={**env, "CANCEL": "1", "PAY_WAIT": "0.3"})
    assert done.returncode == 0, done.stderr
    paid = _ledger(ledger)
    # the same program, its pay now quick: were pay settled and run, it would pay at once
    went = deja("replay", "run.jsonl", "--then", "live", "--", sys.executable, "agent.py",
                cwd=root, env={**env, "CANCEL": "1", "PAY_WAIT": "0"})
    said = went.stdout + went.stderr
    assert went.returncode != 0, said
    assert "ended inside side-effecting tool 'pay'" in said, said
    assert _ledger(ledger) == paid  # nothing paid

