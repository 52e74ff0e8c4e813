"""A side effect made inside a tool's body is never made again by a resume of a run that
was killed while that tool was still running.

A plain tool (``checkout``) calls a side-effecting one (``pay``), directly or through
another plain tool (``process``); a side-effecting tool (``pay_and_tell``) calls another
(``notify``). The agent is killed (SIGKILL) after the inner side effect was made and
before the outer call's line was written, then resumed with the real CLI. The resume runs
the outer body again (a plain tool has no intent to settle), and the inner side effect is
answered from its outcome: the ledger holds each payment and each email once. Before,
the body ran again and paid again.

When the body run again makes a side effect other than the one it had made (other
arguments, or made another way), the resume stops for a person and pays nothing. A fork
at a step recorded while such a call was under way is refused before anything runs.
"""

from __future__ import annotations

import ast
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
CRASH = os.environ.get("CRASH", "")
SHAPE = os.environ.get("SHAPE", "plain")
SEARCHED = asyncio.Event()


def by_key(intent):
    with open(LEDGER) as f:
        keys = [json.loads(line)["key"] for line in f if line.strip()]
    if intent.key in keys:
        return Settled.done({"ok": True, "key": intent.key})
    return Settled.not_done()


def write(what, key):
    with open(LEDGER, "a") as f:
        f.write(json.dumps({"what": what, "key": key, "mode": recorder.mode()}) + "\\n")


def crash(where):
    if CRASH == where:
        os.kill(os.getpid(), signal.SIGKILL)


@recorder.tool(side_effect=True, settle=by_key)
async def pay(invoice, idempotency_key=None):
    crash("in pay")
    write(f"pay {invoice}", idempotency_key)
    return {"ok": True, "key": idempotency_key}


@recorder.tool(side_effect=True)  # no settle function: nothing can tell
async def charge(card, idempotency_key=None):
    crash("in charge")
    write(f"charge {card}", idempotency_key)
    return {"ok": True, "key": idempotency_key}


@recorder.tool(side_effect=True, settle=by_key)
async def notify(email, idempotency_key=None):
    write(f"email {email}", idempotency_key)
    return {"ok": True, "key": idempotency_key}


@recorder.tool
async def process(cart):
    return await pay(cart)


@recorder.tool
async def search(q):
    SEARCHED.set()  # its line is written before checkout, waiting on it, goes on
    return {"q": q}


@recorder.tool
async def checkout(cart):
    suffix = os.environ.get("SUFFIX", "")
    if SHAPE == "nested":
        paid = await process(cart + suffix)
    else:
        paid = await pay(cart + suffix)
    crash(f"after pay {cart}")
    if SHAPE == "beside" and cart == "c1":  # search's line lands while it is under way
        await SEARCHED.wait()
    await asyncio.sleep(0)  # a turn for the calls beside it: two checkouts interleave
    if SHAPE in ("tell", "broad"):
        await notify(f"{cart}@example.com")
        crash(f"after notify {cart}")
    return {"cart": cart, "paid": paid}


@recorder.tool(side_effect=True, settle=by_key)
async def pay_and_tell(invoice, idempotency_key=None):
    await notify(f"{invoice}@example.com")
    crash("after notify")
    write(f"pay {invoice}", idempotency_key)
    return {"ok": True, "key": idempotency_key}


async def main():
    if SHAPE == "outer":
        print(await pay_and_tell("c1"), flush=True)
    elif SHAPE == "two":
        print(await asyncio.gather(checkout("c1"), checkout("c2")), flush=True)
    elif SHAPE == "broad":  # a program that carries on whatever a tool raises
        for cart in ("c1", "c9"):
            try:
                print(await checkout(cart + os.environ.get("SUFFIX", "")), flush=True)
            except Exception as exc:
                print("caught", type(exc).__name__, flush=True)
        return
    elif SHAPE == "charge":
        print(await charge("4242"), flush=True)
    elif SHAPE == "beside":
        print(await asyncio.gather(checkout("c1"), search("q")), flush=True)
    else:
        print(await checkout("c1"), flush=True)
    print(await checkout("c9"), flush=True)


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


def _ledger(ledger: Path) -> list[tuple[str, str]]:
    return [(e["what"], e["mode"]) for e in map(json.loads, ledger.read_text().splitlines())]


def _killed(root: Path, env: dict[str, str], shape: str, where: str) -> None:
    crashed = deja("record", "--no-loop-guard", "-o", "run.jsonl", "--", sys.executable,
                   "agent.py", cwd=root, env={**env, "SHAPE": shape, "CRASH": where})
    assert crashed.returncode != 0 and "it can be resumed" in crashed.stderr, crashed.stderr


def _resume(root: Path, env: dict[str, str], shape: str,
            **more: str) -> subprocess.CompletedProcess[str]:
    return deja("resume", "run.jsonl", "--", sys.executable, "agent.py", cwd=root,
                env={**env, "SHAPE": shape, **more})


@pytest.mark.parametrize("shape", ["plain", "nested"])
def test_a_side_effect_made_inside_a_tool_under_way_is_not_made_again(
        project: tuple[Path, dict[str, str], Path], shape: str) -> None:
    root, env, ledger = project
    _killed(root, env, shape, "after pay c1")
    assert _ledger(ledger) == [("pay c1", "record")]
    resumed = _resume(root, env, shape)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert _ledger(ledger) == [("pay c1", "record"), ("pay c9", "resume")]
    run = load(root / "run.jsonl")
    # the agent got the recorded payment back, with its key
    assert ast.literal_eval(resumed.stdout.splitlines()[0])["paid"]["key"] == f"{run.run}:0"
    assert run.end is not None and run.end["status"] == "completed"
    # the resumed run replays, and its calls never reuse an id of the killed attempt
    replayed = deja("replay", "run.jsonl", "--", sys.executable, "agent.py", cwd=root,
                    env={**env, "SHAPE": shape})
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    opened = [o["call"] for o in run.observations if o["kind"] == "intent"]
    assert len(opened) == len(set(opened)) == 2, opened


@pytest.mark.parametrize("shape", ["plain", "nested"])
def test_a_side_effect_killed_inside_a_tool_under_way_is_settled_and_made_once(
        project: tuple[Path, dict[str, str], Path], shape: str) -> None:
    root, env, ledger = project
    _killed(root, env, shape, "in pay")
    assert _ledger(ledger) == []
    resumed = _resume(root, env, shape)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert _ledger(ledger) == [("pay c1", "resume"), ("pay c9", "resume")]
    run = load(root / "run.jsonl")
    paid = [o for o in run.observations if o["kind"] == "outcome" and o["name"] == "pay"]
    assert paid[0]["intent"] == 0 and paid[0]["key"] == f"{run.run}:0"  # the intent's key


def test_a_side_effect_made_inside_a_side_effect_under_way_is_not_made_again(
        project: tuple[Path, dict[str, str], Path]) -> None:
    root, env, ledger = project
    _killed(root, env, "outer", "after notify")
    assert _ledger(ledger) == [("email c1@example.com", "record")]
    resumed = _resume(root, env, "outer")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    # pay_and_tell settled as not done runs again; its email is answered from its outcome
    assert _ledger(ledger) == [("email c1@example.com", "record"), ("pay c1", "resume"),
                               ("pay c9", "resume")]


def test_two_calls_of_one_tool_under_way_are_told_apart_by_what_they_made(
        project: tuple[Path, dict[str, str], Path]) -> None:
    root, env, ledger = project
    _killed(root, env, "two", "after pay c2")  # both checkouts paid, neither ended
    assert _ledger(ledger) == [("pay c1", "record"), ("pay c2", "record")]
    resumed = _resume(root, env, "two")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert _ledger(ledger) == [("pay c1", "record"), ("pay c2", "record"),
                               ("pay c9", "resume")]
    run = load(root / "run.jsonl")
    served = ast.literal_eval(resumed.stdout.splitlines()[0])
    assert [s["paid"]["key"] for s in served] == [f"{run.run}:0", f"{run.run}:2"]


@pytest.mark.parametrize(("recorded", "resumed_as", "more"), [
    ("plain", "plain", {"SUFFIX": "-changed"}),  # the same tool, other arguments
    ("nested", "plain", {}),  # the payment made another way: directly, not via process
])
def test_a_side_effect_that_might_be_the_one_made_before_stops_the_resume(
        project: tuple[Path, dict[str, str], Path], recorded: str, resumed_as: str,
        more: dict[str, str]) -> None:
    root, env, ledger = project
    _killed(root, env, recorded, "after pay c1")
    resumed = _resume(root, env, resumed_as, **more)
    assert resumed.returncode != 0, resumed.stdout
    assert "NeedsAttention: tool call checkout#0 was under way when the run stopped" \
        in resumed.stderr, resumed.stderr
    assert _ledger(ledger) == [("pay c1", "record")]  # nothing paid
    end = load(root / "run.jsonl", allow_incomplete=True).end
    assert end is not None and end["status"] == "needs_attention", end
    # a run stopped for a person resumes: with the program as recorded, it completes
    fixed = _resume(root, env, recorded)
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "the run ended needs_attention; its end line is cut" in fixed.stderr
    assert _ledger(ledger) == [("pay c1", "record"), ("pay c9", "resume")]


def test_a_fork_inside_a_tool_call_that_made_a_side_effect_is_refused(
        project: tuple[Path, dict[str, str], Path]) -> None:
    root, env, ledger = project
    # checkout pays, then waits; search's line lands before checkout's own
    done = deja("record", "--no-loop-guard", "-o", "run.jsonl", "--", sys.executable,
                "agent.py", cwd=root, env={**env, "SHAPE": "beside"})
    assert done.returncode == 0, done.stderr
    lines = [(o["kind"], o.get("name")) for o in load(root / "run.jsonl").observations]
    assert lines[:4] == [("intent", "pay"), ("outcome", "pay"), ("tool", "search"),
                         ("tool", "checkout")], lines
    paid = _ledger(ledger)
    forked = deja("fork", "run.jsonl", "--at", "2", "--set", 'result={"q": "z"}', "-o",
                  "fork.jsonl", "--live-tool", "pay", "--", sys.executable, "agent.py",
                  cwd=root, env={**env, "SHAPE": "beside"})
    assert forked.returncode == 2, forked.stdout + forked.stderr
    assert "step 2 was recorded while tool call checkout#0 was under way (its line at step " \
        "3), and side-effecting tool 'pay' had been called inside it" in forked.stderr
    assert not (root / "fork.jsonl").exists()
    assert _ledger(ledger) == paid
    # after the call's own line, the fork runs
    after = deja("fork", "run.jsonl", "--at", "3", "--set", 'result={"cart": "c1"}', "-o",
                 "fork.jsonl", "--", sys.executable, "agent.py", cwd=root,
                 env={**env, "SHAPE": "beside"})
    assert after.returncode == 0, after.stdout + after.stderr


def test_a_side_effect_nothing_can_settle_is_run_again_only_when_named(
        project: tuple[Path, dict[str, str], Path]) -> None:
    root, env, ledger = project
    _killed(root, env, "charge", "in charge")
    stopped = _resume(root, env, "charge")
    assert stopped.returncode != 0, stopped.stdout
    assert "has no settle function" in stopped.stderr and "--resend charge" in stopped.stderr
    assert _ledger(ledger) == []
    resent = deja("resume", "--resend", "charge", "run.jsonl", "--", sys.executable,
                  "agent.py", cwd=root, env={**env, "SHAPE": "charge"})
    assert resent.returncode == 0, resent.stdout + resent.stderr
    assert _ledger(ledger) == [("charge 4242", "resume"), ("pay c9", "resume")]
    run = load(root / "run.jsonl")
    assert ast.literal_eval(resent.stdout.splitlines()[0])["key"] == f"{run.run}:0"


def test_a_resume_of_a_resume_makes_each_side_effect_once(
        project: tuple[Path, dict[str, str], Path]) -> None:
    """The body run again says which call it continues (a ``continues`` line): killed
    again after its email, a second resume knows the payment and the email as that
    call's, and sends neither again; the call, ended, no longer stops a fork."""
    root, env, ledger = project
    _killed(root, env, "tell", "after pay c1")
    again = _resume(root, env, "tell", CRASH="after notify c1")
    assert again.returncode != 0, again.stdout
    assert _ledger(ledger) == [("pay c1", "record"), ("email c1@example.com", "resume")]
    done = _resume(root, env, "tell")
    assert done.returncode == 0, done.stdout + done.stderr
    assert _ledger(ledger) == [("pay c1", "record"), ("email c1@example.com", "resume"),
                               ("pay c9", "resume"), ("email c9@example.com", "resume")]
    run = load(root / "run.jsonl")
    continues = [o for o in run.observations if o.get("event") == "continues"]
    assert [o["detail"]["call"] for o in continues] == ["checkout#0", "checkout#0"]
    ended = next(o for o in run.observations if o["kind"] == "tool"
                 and o["name"] == "checkout" and o["args"] == {"cart": "c1"})
    forked = deja("fork", "run.jsonl", "--at", str(ended["seq"]), "--set",
                  'result={"cart": "c1"}', "-o", "fork.jsonl", "--", sys.executable,
                  "agent.py", cwd=root, env={**env, "SHAPE": "tell"})
    assert forked.returncode == 0, forked.stdout + forked.stderr


def test_a_replay_then_live_never_runs_again_a_body_that_made_a_side_effect(
        project: tuple[Path, dict[str, str], Path]) -> None:
    root, env, ledger = project
    _killed(root, env, "plain", "after pay c1")
    went = deja("replay", "run.jsonl", "--allow-incomplete", "--then", "live", "--live-tool",
                "pay", "-o", "live.jsonl", "--", sys.executable, "agent.py", cwd=root,
                env={**env, "SHAPE": "plain"})
    assert "tool call checkout#0 was under way where this run's recorded steps end" \
        in went.stderr, went.stdout + went.stderr
    assert _ledger(ledger) == [("pay c1", "record")]  # pay, named live, not made again
    end = load(root / "live.jsonl").end
    assert end is not None and end["status"] == "needs_attention", end


def test_a_program_that_catches_the_stop_still_ends_needing_attention(
        project: tuple[Path, dict[str, str], Path]) -> None:
    root, env, ledger = project
    _killed(root, env, "broad", "after pay c1")
    stopped = _resume(root, env, "broad", SUFFIX="-changed")
    assert "caught NeedsAttention" in stopped.stdout, stopped.stdout + stopped.stderr
    end = load(root / "run.jsonl").end
    assert end is not None and end["status"] == "needs_attention", end
    assert _ledger(ledger) == [("pay c1", "record")]
    # the checkout stopped inside left no line: the next resume runs it again
    done = _resume(root, env, "broad")
    assert done.returncode == 0, done.stdout + done.stderr
    assert _ledger(ledger) == [("pay c1", "record"), ("email c1@example.com", "resume"),
                               ("pay c9", "resume"), ("email c9@example.com", "resume")]


def test_a_needs_attention_the_program_raises_itself_is_the_tool_s_error(
        tmp_path: Path) -> None:
    """Only the stops deja makes leave a tool call under way: a tool that raises
    ``recorder.NeedsAttention`` itself has its line, with that error, and replays."""
    import recorder
    import replayer

    @recorder.tool
    def approve(amount: int) -> str:
        if amount > 100:
            raise recorder.NeedsAttention(f"amount {amount} needs a person")
        return "ok"

    def agent() -> list[str]:
        said = []
        for amount in (50, 500, 60):
            try:
                said.append(approve(amount))
            except recorder.NeedsAttention as exc:
                said.append(str(exc))
        return said

    path = tmp_path / "run.jsonl"
    with recorder.record(path):
        live = agent()
    run = load(path)
    assert [o["kind"] for o in run.observations] == ["tool"] * 3
    assert run.observations[1]["error"]["type"] == "NeedsAttention"
    assert run.end is not None and run.end["status"] == "completed"
    with replayer.replay(path) as replayed:
        assert agent() == live
    assert replayed.result is not None and replayed.result.identical
