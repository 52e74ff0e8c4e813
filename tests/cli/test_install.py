"""deja installed the way a project installs it, outside the repository.

The README's Install block runs as written in a copy of the repository: it builds the
wheel and installs it into a fresh virtualenv in a project folder beside the copy, with
its dependencies from the package index. From that project (no checkout on its path):
the wheel holds the four top-level packages and nothing generic, the quickstart records
and replays against the stub, the CLI records an agent and replays it with no key and no
model, the pytest plugin replays it as an incident and fails on a changed agent with
deja's report, and the viewer serves the run.
"""

from __future__ import annotations

import http.cookiejar
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_docs import console_blocks, copy_repository, run_block

ROOT = Path(__file__).resolve().parents[2]
INSTALL = "Install"
TIMEOUT = 900  # pip resolves and installs every dependency from the index: minutes at worst

AGENT = '''\
import anthropic, recorder

@recorder.tool
def lookup(invoice: str) -> str:
    return f"{invoice}: unpaid"

def main(question: str = "Is INV-7 paid?") -> str:
    client = anthropic.Anthropic()
    reply = client.messages.create(model="claude-sonnet-4-6", max_tokens=256,
                                   messages=[{"role": "user", "content": question}])
    return reply.content[0].text + " / " + lookup("INV-7")

if __name__ == "__main__":
    print(main())
'''

INCIDENT_TEST = '''\
import pytest
import agent

@pytest.mark.deja("incidents/inv-7.jsonl", record=False)
def test_the_agent_answers_as_it_did():
    assert agent.main().endswith("INV-7: unpaid")
'''


@dataclass
class Project:
    """A project folder outside the repository, with deja installed into its own venv."""

    folder: Path
    env: dict[str, str]

    @property
    def bin(self) -> Path:
        return self.folder / ".venv" / "bin"

    def run(self, *argv: str | Path, status: int = 0,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([str(a) for a in argv], cwd=self.folder, env=env or self.env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == status, (argv, done.returncode, done.stdout, done.stderr)
        return done

    def deja(self, *argv: str | Path, status: int = 0,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return self.run(self.bin / "deja", *argv, status=status, env=env)


def user_env(home: Path) -> dict[str, str]:
    """A new user's shell: no key, no deja settings, nothing of this suite's venv. Its
    home is a new one (no ~/.deja); pip keeps the machine's download cache, as a user's
    own pip would have one, so that the dependencies this suite's virtualenv was installed
    with are not all downloaded from the index again."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DEJA_", "ANTHROPIC_", "OPENAI_", "PYTHON", "VIRTUAL_ENV"))}
    suite_bin = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if p != suite_bin)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pip"
    env.setdefault("PIP_CACHE_DIR", str(cache))
    env.update(HOME=str(home), COLUMNS="160", NO_COLOR="1")
    return env


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Project:
    """The README's Install block, run as written from a copy of the repository."""
    base = tmp_path_factory.mktemp("install")
    copy = copy_repository(base / "deja")
    [(_, commands)] = [b for b in console_blocks((ROOT / "README.md").read_text())
                       if b[0] == INSTALL]
    env = user_env(base / "home")
    # `make wheel` uses this suite's venv for pip (as a reader's clone uses its own), and
    # the block's `python` is that venv's interpreter, as after `make demo`.
    env.update(VENV=str(Path(sys.executable).parent.parent),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}")
    where = run_block(commands, copy, env, base / "out", where=INSTALL, timeout=TIMEOUT)
    folder = base / "my-agent"
    assert (folder / ".venv" / "bin" / "deja").is_file(), where
    return Project(folder, user_env(base / "home"))


@contextmanager
def stub_model(project: Project, folder: Path) -> Iterator[str]:
    """``deja stub`` from the installed wheel, answering every request the same way."""
    script = folder / "model.stub.json"
    script.write_text('{"default": {"text": "INV-7 is not paid yet."}}')
    ready = folder / "stub-ready"
    server = subprocess.Popen([project.bin / "deja", "stub", "--script", script, "--port", "0",
                               "--ready-file", ready], cwd=project.folder, env=project.env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():  # written once the stub listens
            assert server.poll() is None and time.monotonic() < deadline, "no stub"
            time.sleep(0.05)
        yield ready.read_text().strip()
    finally:
        server.terminate()
        server.wait(timeout=60)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_the_wheel_installs_four_packages_and_no_generic_name(project: Project) -> None:
    site = project.run(project.bin / "python", "-c",
                       "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout
    [record] = Path(site.strip()).glob("deja_replay-*.dist-info/RECORD")
    tops = {line.split("/")[0] for line in record.read_text().splitlines()
            if line and not line.startswith(("..", "deja_replay-"))}
    assert tops == {"deja", "recorder", "replayer", "viewer"}, tops
    where = project.run(project.bin / "python", "-c",
                        "import deja.proxy, deja.runs, recorder, replayer, viewer;"
                        "print(deja.proxy.__file__)").stdout
    assert where.startswith(site.strip()) and str(ROOT) not in where, where
    for generic in ("proxy", "runs"):
        missing = project.run(project.bin / "python", "-c", f"import {generic}", status=1)
        assert f"No module named '{generic}'" in missing.stderr


def test_the_quickstart_records_and_replays_from_the_project(
        project: Project, tmp_path: Path) -> None:
    shutil.copy(ROOT / "examples" / "quickstart.py", project.folder / "quickstart.py")
    with stub_model(project, tmp_path) as url:
        env = {**project.env, "ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "sk-stub"}
        done = project.run(project.bin / "python", "quickstart.py", env=env)
    assert re.search(r"replay of r_\w+ \(cassettes/demo/quickstart.jsonl\): identical",
                     done.stdout), done.stdout
    assert (project.folder / "cassettes" / "demo" / "quickstart.jsonl").is_file()


def test_an_incident_replays_from_the_cli_and_from_pytest(
        project: Project, tmp_path: Path) -> None:
    (project.folder / "agent.py").write_text(AGENT)
    with stub_model(project, tmp_path) as url:
        recorded = project.deja("record", "-o", "incidents/inv-7.jsonl", "--",
                                "python", "agent.py",
                                env={**project.env, "ANTHROPIC_BASE_URL": url,
                                     "ANTHROPIC_API_KEY": "sk-stub",
                                     "PATH": f"{project.bin}{os.pathsep}{project.env['PATH']}"})
    assert "INV-7 is not paid yet. / INV-7: unpaid" in recorded.stdout
    offline = {**project.env, "PATH": f"{project.bin}{os.pathsep}{project.env['PATH']}"}
    replayed = project.deja("replay", "incidents/inv-7.jsonl", env=offline)  # no key, no model
    assert "identical" in replayed.stdout and "verified with key" in replayed.stdout

    project.run(project.bin / "python", "-m", "pip", "install", "-q", "pytest>=8")
    (project.folder / "test_incident.py").write_text(INCIDENT_TEST)
    passed = project.run(project.bin / "python", "-m", "pytest", "-q", "-p",
                         "no:cacheprovider", "test_incident.py", env=offline)
    assert "1 passed" in passed.stdout
    (project.folder / "agent.py").write_text(AGENT.replace("Is INV-7 paid?", "Pay INV-7 now."))
    failed = project.run(project.bin / "python", "-m", "pytest", "-q", "-p",
                         "no:cacheprovider", "test_incident.py", status=1, env=offline)
    assert "DIVERGED" in failed.stdout and "Pay INV-7 now." in failed.stdout, failed.stdout


def test_the_viewer_serves_the_runs_from_the_wheel(project: Project, tmp_path: Path) -> None:
    port, said = free_port(), tmp_path / "view.err"
    with said.open("w") as err:
        viewer = subprocess.Popen([project.bin / "deja", "view", "incidents", "--port", str(port)],
                                  cwd=project.folder, env=project.env,
                                  stdout=subprocess.DEVNULL, stderr=err)
    try:
        project.deja("wait", str(port), "--timeout", "120")
        [address] = re.findall(r"http://127\.0\.0\.1:\d+/\?token=\S+", said.read_text())
        browser = urllib.request.build_opener(  # the token becomes a cookie, then the page
            urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar()))
        with browser.open(address, timeout=60) as page:
            assert page.status == 200 and b"<html" in page.read().lower()
    finally:
        viewer.terminate()
        viewer.wait(timeout=60)
