"""One status everywhere: for a run that completed, one whose program exited 1 after its
last step, one cancelled while it worked, and one that failed (its agent died) and was
then resumed by hand, ``deja status --json``, ``deja runs --json``, ``GET /runs/{id}``, ``deja show
--json``, ``deja ls --json``, ``deja verify``, ``deja export`` and the run's status record say
the same word (:func:`recorder.cassette.schema.run_status`:
the end line first; an end line's ``error`` is ``failed``).

Real processes: ``deja serve``, one ``deja worker``, the CLI as a user runs it, and ``deja
resume`` by hand in the run's directory.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from runs_helpers import base_env

from deja.runs.store import ENDED

TIMEOUT = 180.0  # for a run to end on two busy cores

AGENTS = {
    "ok.py": "import recorder\nrecorder.now()\nprint('done')\n",
    "exit1.py": "import sys\nimport recorder\nrecorder.now()\nsys.exit(1)\n",
    "slow.py": ("import time\nimport recorder\n\n@recorder.tool\ndef tick(i):\n"
                "    return i\n\nfor i in range(600):\n    recorder.now()\n    tick(i)\n"
                "    time.sleep(0.1)\n"),
    # dies (SIGKILL) until the file 'fixed' exists: a resume by hand, once it does, completes
    "flaky.py": ("import os, pathlib, signal\nimport recorder\nrecorder.now()\n"
                 "if not pathlib.Path('fixed').exists():\n"
                 "    os.kill(os.getpid(), signal.SIGKILL)\nprint('done')\n"),
}


class Service:
    """``deja serve`` and a worker on one DEJA_HOME, and the CLI against them."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.home = folder / "home"
        self.work = folder / "work"
        self.work.mkdir()
        for name, source in AGENTS.items():
            (self.work / name).write_text(source)
        self.env = base_env(self.home, DEJA_AGENT_RETRIES="none")  # a death fails at once
        self.procs: list[subprocess.Popen[bytes]] = []
        ready = folder / "serve.json"
        try:
            self._start("serve", ["serve", "--port", "0", "--quiet", "--ready-file",
                                  str(ready)])
            self._until("deja serve to listen", lambda: ready.exists())
            self.url = json.loads(ready.read_text())["url"]
            self.env["DEJA_SERVER"] = self.url
            self._start("worker", ["worker", "--id", "w1"])
            self._until("the worker to be up", lambda: "is up" in self.log("worker"))
            self.token = (self.home / "serve.token").read_text().strip()
        except BaseException:
            self.stop()
            raise

    def _start(self, name: str, args: list[str]) -> None:
        with (self.folder / f"{name}.log").open("wb") as log:
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "deja", *args], env=self.env, cwd=self.work,
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True))

    def log(self, name: str) -> str:
        return (self.folder / f"{name}.log").read_text(errors="replace")

    def _until(self, what: str, probe: Any) -> Any:
        deadline = time.monotonic() + TIMEOUT
        while True:
            got = probe()
            if got:
                return got
            for proc in self.procs:
                assert proc.poll() is None, f"{what}: a process exited\n{self.logs()}"
            assert time.monotonic() < deadline, f"{what} did not happen\n{self.logs()}"
            time.sleep(0.1)

    def logs(self) -> str:
        return "\n".join(f"--- {n}\n{self.log(n)}" for n in ("serve", "worker")
                         if (self.folder / f"{n}.log").exists())

    def deja(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "deja", *args], env=self.env,
                              cwd=self.work, capture_output=True, text=True, timeout=120)

    def get(self, run_id: str) -> dict[str, Any]:
        request = urllib.request.Request(f"{self.url}/runs/{run_id}",
                                         headers={"authorization": f"Bearer {self.token}"})
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(request, timeout=60) as response:
            return dict(json.loads(response.read()))

    def submit(self, agent: str) -> str:
        done = self.deja("submit", "--", sys.executable, agent)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    def settled(self, run_id: str) -> dict[str, Any]:
        """The run's record once it ended and the worker is done with it."""
        def probe() -> dict[str, Any] | None:
            record = self.get(run_id)
            listed = self.listed(run_id)
            return record if record["status"] in ENDED and listed.get("ended") else None
        return dict(self._until(f"run {run_id} to end", probe))

    def listed(self, run_id: str) -> dict[str, Any]:
        done = self.deja("runs", "--json", "--limit", "1000")
        assert done.returncode == 0, done.stderr
        return next(r for r in json.loads(done.stdout)["runs"] if r["run_id"] == run_id)

    def everywhere(self, run_id: str) -> dict[str, str]:
        """What each reader says the run's status is."""
        cassette = self.home / "cassettes" / f"{run_id}.jsonl"
        status = self.deja("status", run_id, "--json")
        assert status.returncode == 0, status.stderr
        show = self.deja("show", str(cassette), "--json")
        assert show.returncode == 0, show.stderr
        listing = self.deja("ls", str(cassette.parent), "--json")
        assert listing.returncode == 0, listing.stderr
        verify = self.deja("verify", str(cassette), "--allow-incomplete")
        assert verify.returncode == 0, verify.stderr
        spans = self.deja("export", str(cassette), "--format", "otlp-json", "-o", "-")
        assert spans.returncode == 0, spans.stderr
        root = json.loads(spans.stdout)["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
        record = json.loads((self.home / "runs" / f"{run_id}.json").read_text())
        return {"status record": record["status"],
                "deja verify": verify.stdout.rsplit("end: ", 1)[-1].split(" (")[0].strip(),
                "deja export": next(a["value"]["stringValue"] for a in root["attributes"]
                                    if a["key"] == "deja.run.status"),
"deja status": json.loads(status.stdout)["status"],
                "deja runs": self.listed(run_id)["status"],
                "GET /runs/{id}": self.get(run_id)["status"],
                "deja show": json.loads(show.stdout)["run"]["status"],
                "deja ls": next(r["status"] for r in json.loads(listing.stdout)
                                if r["run"] == run_id)}

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Service]:
    made = Service(tmp_path)
    try:
        yield made
    finally:
        made.stop()


def _agree(service: Service, run_id: str, expected: str) -> None:
    seen = service.everywhere(run_id)
    assert set(seen.values()) == {expected}, f"run {run_id}: {seen}\n{service.logs()}"


def test_completed_exit_1_cancelled_and_resumed_runs_have_one_status_everywhere(
        service: Service) -> None:
    ok, exit1, flaky = (service.submit(a) for a in ("ok.py", "exit1.py", "flaky.py"))
    assert service.settled(ok)["status"] == "completed"
    _agree(service, ok, "completed")

    ended = service.settled(exit1)
    assert ended["status"] == "failed", ended
    _agree(service, exit1, "failed")  # the program handed over completed

    # Failed (its agent died, no retries here), then fixed and resumed by hand: the end
    # line it ends with now is the truth.
    assert service.settled(flaky)["status"] == "failed"
    _agree(service, flaky, "failed")
    (service.work / "fixed").write_text("yes")
    cassette = service.home / "cassettes" / f"{flaky}.jsonl"
    resumed = service.deja("resume", str(cassette))
    assert resumed.returncode == 0, resumed.stderr
    _agree(service, flaky, "completed")
    assert "error" not in service.get(flaky)

    slow = service.submit("slow.py")
    service._until("the slow run to work", lambda: str(
        service.get(slow).get("step") or "").startswith("tool tick"))
    cancelled = service.deja("cancel", slow)
    assert cancelled.returncode == 0, cancelled.stderr
    assert service.settled(slow)["status"] == "cancelled"
    record = service.listed(slow)
    assert record["step"] == "ended: cancelled", record
    _agree(service, slow, "cancelled")
