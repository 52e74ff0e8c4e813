"""The incidents the ``deja suite`` tests judge: one order agent, four behaviours recorded
once against the stub model, and a folder of twenty made of copies of them.

The agent asks the model what to do with order A7, plans a refund if told to (a tool),
and asks for a summary. The model's first answer makes the behaviour:

- ``nothing`` (``NOTHING``) and ``refund-30`` (``REFUND 30``): the run completes;
- ``refund-all`` (``REFUND ALL``): the agent parses the amount as a number and crashes
  (the recorded run failed, exit status 1);
- ``refund-0`` (``REFUND 0``): a refund of nothing, which the agent goes through with.

The change (``fixed.py``) understands ``ALL`` (the three ``refund-all`` incidents now
complete, going live at the tool call their recording never reached) and refuses a refund
of nothing (the ``refund-0`` incident now fails): it fixes three and breaks one.
``late.py`` makes the same calls as the agent and then exits 1 on ``NOTHING``: a plain
replay passes but the run now fails. A copy of a cassette under another name keeps its
signature (its bytes are unchanged), so the twenty are copies of the four.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from recorder.testing.server import StubServer

QUESTION = "Order A7: what should I do?"
AGENT = f'''\
import anthropic
import recorder


@recorder.tool
def plan_refund(order, amount):
    return {{"order": order, "amount": amount}}


client = anthropic.Anthropic(max_retries=0)


def ask(text):
    reply = client.messages.create(model="claude-sonnet-4-6", max_tokens=64,
                                   messages=[{{"role": "user", "content": text}}])
    return reply.content[0].text


decision = ask({QUESTION!r})
word, _, arg = decision.partition(" ")
if word == "REFUND":
    amount = int(arg)
    plan_refund("A7", amount)
print(ask(f"Summarise: {{decision}}"))
'''
FIXED = AGENT.replace("    amount = int(arg)\n", '''\
    amount = 100 if arg == "ALL" else int(arg)
    if amount == 0:
        raise ValueError("a refund of nothing")
''')
LATE = AGENT + 'if decision == "NOTHING":\n    raise SystemExit(1)\n'
BEHAVIOURS = {"nothing": "NOTHING", "refund-30": "REFUND 30", "refund-all": "REFUND ALL",
              "refund-0": "REFUND 0"}
# What the fix does to each, with --then (the live part answered by the stub).
WITH_FIX = {"nothing": "identical", "refund-30": "identical", "refund-all": "now_completes",
            "refund-0": "now_fails"}
# Twenty incidents, in the order their names sort: 8 + 8 that stay the same, the 3 the fix
# fixes (one early, so that a worker killed mid-suite has one live) and the 1 it breaks.
TWENTY = ("nothing", "refund-30", "refund-all", "nothing", "refund-30", "nothing",
          "refund-30", "refund-0", "nothing", "refund-all", "refund-30", "nothing",
          "refund-30", "nothing", "refund-30", "refund-all", "nothing", "refund-30",
          "nothing", "refund-30")
LIVE_ANSWER = "Summary: done."


def script_for(answer: str) -> dict[str, Any]:
    """The stub model of one behaviour: ``answer`` to the question, then a summary."""
    return {"rules": [{"when": {"last_user": QUESTION}, "text": answer}],
            "default": {"text": "Summary: ok."}}


def live_script(delay_ms: int = 0) -> dict[str, Any]:
    """The stub the live part of a replay-then-live talks to (slow, if asked)."""
    return {"default": {"text": LIVE_ANSWER, **({"delay_ms": delay_ms} if delay_ms else {})}}


def deja(*args: str, cwd: Path, env: dict[str, str],
         timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "deja", *args], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=timeout)


def record_project(folder: Path, env: dict[str, str]) -> Path:
    """The project: the agent, the fix, the late failure, the live stub's script, and each
    behaviour recorded once with ``deja record`` under ``recorded/``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "agent.py").write_text(AGENT)
    (folder / "fixed.py").write_text(FIXED)
    (folder / "late.py").write_text(LATE)
    (folder / "live.stub.json").write_text(json.dumps(live_script()))
    for name, answer in BEHAVIOURS.items():
        with StubServer(script_for(answer)) as server:
            done = deja("record", "-o", f"recorded/{name}.jsonl", "--", "python", "agent.py",
                        cwd=folder, env={**env, "ANTHROPIC_BASE_URL": server.url,
                                         "ANTHROPIC_API_KEY": "sk-stub"})
        assert done.returncode == (1 if name == "refund-all" else 0), done.stderr
    return folder


def make_incidents(project: Path, layout: tuple[str, ...] = TWENTY,
                   folder: str = "incidents") -> dict[str, str]:
    """Copy the recorded behaviours into ``project/folder`` as ``NN-<behaviour>.jsonl``, in
    ``layout``'s order; each file's name -> its behaviour."""
    target = project / folder
    target.mkdir(parents=True, exist_ok=True)
    made = {}
    for n, behaviour in enumerate(layout):
        name = f"{n:02d}-{behaviour}.jsonl"
        shutil.copyfile(project / "recorded" / f"{behaviour}.jsonl", target / name)
        made[name] = behaviour
    return made


def suite_env(env: dict[str, str], **extra: str) -> dict[str, str]:
    """The environment ``deja suite`` (or a worker) runs with: the key a live part's SDK
    needs, no GitHub Actions unless asked."""
    base = {k: v for k, v in env.items() if k not in ("GITHUB_ACTIONS", "DEJA_DATABASE_URL")}
    return {**base, "ANTHROPIC_API_KEY": "sk-stub", **extra}


def check_the_fix(document: dict[str, Any], made: dict[str, str], outdir: Path) -> None:
    """A --then suite of the fix over ``made``: exactly the three fixed and the one broken,
    the fixed ones' live parts spent, one finished, signed cassette per incident."""
    from recorder.cassette import load

    records = {r["incident"]: r for r in document["incidents"]}
    assert sorted(records) == sorted(made)
    verdicts = {name: records[name]["verdict"] for name in made}
    assert verdicts == {name: WITH_FIX[b] for name, b in made.items()}, verdicts
    counts = Counter(WITH_FIX[b] for b in made.values())
    summary = document["summary"]
    assert (summary["identical"], summary["now_completes"], summary["now_fails"],
            summary["changed"], summary["error"]) == (
        counts["identical"], counts["now_completes"], counts["now_fails"], 0, 0), summary
    assert summary["exit_status"] == 1
    for name, behaviour in made.items():
        record = records[name]
        new = load(outdir / name)  # signed, whole: verified and ended
        assert new.end is not None and record["new_cassette"], record
        if behaviour == "refund-all":
            assert (record["changed_at"], record["change"]) == (1, "extra_call"), record
            assert record["live"]["model_calls"] == 1 and record["live"]["tool_calls"] == 1
            assert record["live"]["cost_usd"] > 0
            assert record["recorded"] == {"status": "failed", "exit_code": 1,
                                          "completed": False}
            assert new.end["status"] == "completed"
        else:
            assert record["live"]["model_calls"] == 0 and record["changed_at"] is None
    assert sorted(p.name for p in outdir.glob("*.jsonl")) == sorted(made)
    assert summary["live"]["model_calls"] == counts["now_completes"]
