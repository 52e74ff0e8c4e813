"""The README and the pages under docs/ tell the truth: their commands exist, their examples
run, the demo works, and every console block runs as written."""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import anthropic
import click
import pytest
from anthropic.types import MessageParam, TextBlock, ToolUseBlock
from click.testing import CliRunner

from deja.cli import main
from recorder.testing.script import load_script
from recorder.testing.server import StubServer

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
# The pages under docs/, in the order the README lists them: their console blocks run after
# the README's, in this order, in the same copy of the repository (a page may use what an
# earlier one made, as a reader following them in order would).
PAGES = ("replay.md", "ci.md", "drift.md", "guards.md", "fork-and-resume.md", "diff.md",
         "suite.md", "runs.md", "proxy.md", "viewer.md", "integrations.md", "stub.md", "format.md",
         "trust.md", "benchmarks.md")
DOCS = {"README.md": README} | {f"docs/{page}": (ROOT / "docs" / page).read_text()
                                for page in PAGES}
# Run elsewhere: the Install block builds a wheel and installs it into a new virtualenv.
RUN_ELSEWHERE = {("README.md", "Install"): "tests/cli/test_install.py"}


def test_every_cli_command_is_in_the_readme_and_back() -> None:
    commands = set(main.list_commands(click.Context(main)))
    for name in commands:
        assert f"`deja {name}" in README, f"deja {name} is not documented in the README"
    mentioned = set(re.findall(r"`deja ([a-z]+)", README)) | set(
        re.findall(r"^\$ deja ([a-z]+)", README, flags=re.M))
    assert mentioned <= commands, f"README mentions unknown commands {mentioned - commands}"


def test_the_front_door_says_what_how_to_install_and_how_to_use() -> None:
    """What deja is, Install, the two commands, the ten lines, then your own agent; the
    manual lives under docs/, each page linked from the README."""
    headings = re.findall(r"^## (.+)$", README, flags=re.M)
    assert headings[:4] == ["Install", "Two commands", "Record and replay in ten lines",
                            "Use it on your agent"], headings
    two = README.split("## Two commands", 1)[1].split("```console", 1)[1].split("```", 1)[0]
    assert "make demo" in two and "make test" in two
    assert len(README.splitlines()) <= 300
    for page in PAGES:
        assert f"](docs/{page})" in README, f"docs/{page} is not linked from the README"


def test_links_between_the_pages_land_on_a_heading() -> None:
    def anchors(text: str) -> set[str]:
        return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
                for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}

    for name, text in DOCS.items():
        here = (ROOT / name).parent
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([\w-]+))?\)", text):
            if target.startswith(("http://", "https://")):
                continue
            path = (here / target).resolve() if target else ROOT / name
            assert path.exists(), f"{name} links to {target}, which does not exist"
            if anchor:
                assert path.suffix == ".md" and anchor in anchors(path.read_text()), \
                    f"{name} links to {target}#{anchor}: no such heading"


def test_the_ten_line_example_is_the_example_file() -> None:
    """The README shows examples/quickstart.py whole; the console blocks run it."""
    code = README.split("## Record and replay in ten lines", 1)[1]
    code = code.split("```python", 1)[1].split("```", 1)[0]
    assert code.strip() == (ROOT / "examples" / "quickstart.py").read_text().strip()
    assert len([line for line in code.strip().splitlines() if line.strip()]) <= 16


def test_the_stub_script_example_is_a_script_the_stub_serves() -> None:
    """The README's example stub script loads as written and answers the SDK over HTTP."""
    section = DOCS["docs/stub.md"].split("## The stub model: `deja stub`", 1)[1]
    section = section.split("\n## ", 1)[0]
    script = load_script(section.split("```json\n", 1)[1].split("```", 1)[0])
    with StubServer(script) as server:
        client = anthropic.Anthropic(base_url=server.url, api_key="sk-stub", max_retries=0)
        question: MessageParam = {"role": "user", "content": "Fix the session refresh."}
        reply = client.messages.create(model="claude-sonnet-4-6", max_tokens=64,
                                       messages=[question])
        said, call = reply.content
        assert isinstance(said, TextBlock) and said.text == "I'll search."
        assert isinstance(call, ToolUseBlock) and (call.name, call.input) == (
            "search", {"query": "session refresh"})
        assert reply.stop_reason == "tool_use"
        # A request with a tool result that is no error: the rule answers, not the turn.
        fixed = client.messages.create(model="claude-sonnet-4-6", max_tokens=64, messages=[
            question, {"role": "assistant", "content": reply.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                          "content": "auth/session.py"}]}])
        answer = fixed.content[0]
        assert isinstance(answer, TextBlock)
        assert answer.text == "Fixed: refresh_token now renews the session."
        assert server.served == 2


SCREENSHOTS = ("viewer-run.png", "viewer-step.png", "viewer-diff.png", "viewer-fork.png",
               "viewer-submitted.png")


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk, the first after the signature."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path.name} is not a PNG"
    assert head[12:16] == b"IHDR", f"{path.name} has no IHDR first"
    width, height = struct.unpack(">II", head[16:24])
    return width, height


def test_the_viewer_page_embeds_the_screenshots_at_1400_px() -> None:
    embedded = re.findall(r"!\[[^\]]*\]\((viewer-[\w-]+\.png)\)", DOCS["docs/viewer.md"])
    assert sorted(embedded) == sorted(SCREENSHOTS)
    tracked = subprocess.run(["git", "ls-files", "docs"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.split()
    for name in SCREENSHOTS:
        assert f"docs/{name}" in tracked, f"docs/{name} is not committed"
        width, height = png_size(ROOT / "docs" / name)
        assert width == 1400 and height > 0, (name, width, height)


# --------------------------------------------------------------------------- console blocks
#
# Every ```console block of the README runs, in order, in a fresh copy of the repository
# (its files as git sees them, no cassettes recorded, no key): each `$ ` line is a command
# (a trailing backslash continues it), the lines below it are what it prints. A command
# exits 0 unless its comment says "exit status N". What a command prints must match the
# lines shown, where `…` stands for anything and a number for any number.

def console_blocks(text: str) -> list[tuple[str, list[tuple[str, list[str]]]]]:
    """(section, [(command, expected output lines)]) for each console block with prompts."""
    blocks = []
    section = ""
    for part in re.split(r"(^```console\n.*?^```$)", text, flags=re.M | re.S):
        if not part.startswith("```console"):
            headings = re.findall(r"^#+ (.+)$", part, flags=re.M)
            section = headings[-1] if headings else section
            continue
        commands: list[tuple[str, list[str]]] = []
        lines = part.splitlines()[1:-1]
        i = 0
        while i < len(lines):
            line = lines[i]
            if line.startswith("$ "):
                command = line[2:]
                while command.endswith("\\") and i + 1 < len(lines):
                    i += 1
                    command = command + "\n" + lines[i]
                commands.append((command, []))
            elif commands and line.strip():
                commands[-1][1].append(line)
            i += 1
        if commands:
            blocks.append((section, commands))
    return blocks


def expected_status(command: str) -> int:
    found = re.search(r"#.*exit status (\d+)", command)
    return int(found.group(1)) if found else 0


def line_pattern(expected: str) -> re.Pattern[str]:
    """An expected output line as a pattern: `…` is anything, a number any number."""
    out = []
    for piece in re.split(r"(…|\d[\d,.]*)", " ".join(expected.split())):
        if piece == "…":
            out.append(".*?")
        elif piece and piece[0].isdigit():
            out.append(r"[\d,.]+")
        else:
            out.append(re.escape(piece))
    return re.compile("".join(out))


def port_of(command: str) -> int | None:
    found = re.search(r"--port (\d+)", command)
    return int(found.group(1)) if found else (8501 if command.startswith("deja view") else None)


def block_script(commands: list[tuple[str, list[str]]], marks: Path) -> str:
    """A bash script running the commands one by one; each one's output goes to its own
    file and its exit status is checked. A server started with `&` is not waited for: the
    block must wait for it itself (``deja wait PORT``), as it must in a reader's shell."""
    steps = ["set -u"]
    for n, (command, _) in enumerate(commands):
        out = marks / f"{n}.out"
        if command.startswith("deja view"):  # runs until stopped: serve, answer, stop
            steps.append(f"{command.split('#')[0].rstrip()} >{out} 2>&1 &")
            # the address it printed, with its token: a cookie, then the page
            steps.append(f"VIEW=$!; wait_port {port_of(command)} && "
                         "python -c \"import re, urllib.request as u, http.cookiejar as c; "
                         "url = re.search(r'http://127[.]0[.]0[.]1:[0-9]+/[?]token=[^ ]+', "
                         f"open('{out}').read()).group(0); "
                         "u.build_opener(u.HTTPCookieProcessor(c.CookieJar())).open(url, "
                         f"timeout=30)\" >>{out} || "
                         f"{{ echo 'FAILED {n}: no viewer'; exit 1; }}; kill $VIEW")
            continue
        background = command.split("#")[0].rstrip().endswith("&")
        if background:  # the block itself waits for it (deja wait), as a reader's shell must
            steps.append(f"{command.split('#')[0].rstrip()[:-1]} >{out} 2>&1 &")
            continue
        steps.append(f"{{\n{command}\n}} >{out} 2>&1; rc=$?")
        steps.append(f"[ $rc -eq {expected_status(command)} ] || "
                     f"{{ echo \"FAILED {n}: exit status $rc\"; exit 1; }}")
    # A block stops what it starts, so the next one (or a reader's next command in the
    # same shell) finds its ports free.
    for port in sorted({p for c, _ in commands if (p := port_of(c)) and "&" in c}):
        steps.append(f"wait_free {port} || {{ echo 'FAILED: port {port} is still served "
                     "after the block (stop the server it started)'; exit 1; }")
    prelude = ("wait_port() { for _ in $(seq 200); do (exec 3<>/dev/tcp/127.0.0.1/$1) "
               "2>/dev/null && return 0; sleep 0.05; done; return 1; }\n"
               "wait_free() { for _ in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/$1) "
               "2>/dev/null || return 0; sleep 0.05; done; return 1; }\n"
               "trap 'kill $(jobs -p) 2>/dev/null' EXIT\n")
    return prelude + "\n".join(steps) + "\n"


def copy_repository(copy: Path) -> Path:
    """The repository as a fresh clone has it, at ``copy``: tracked and new files, nothing
    ignored; only the Node examples' dependencies, which `make node` installs, are linked
    in, so a console block can run those agents, and the modules `make bytecode` compiled
    are copied beside their sources (a cache: Python checks each against its source, whose
    time the copy keeps, and compiles anew what differs)."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    folders = set()
    for name in filter(None, files):
        source = ROOT / name
        if source.is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, copy / name)
            folders.add(Path(name).parent)
    for folder in folders:
        if (ROOT / folder / "__pycache__").is_dir():
            shutil.copytree(ROOT / folder / "__pycache__", copy / folder / "__pycache__",
                            dirs_exist_ok=True)
    for example in ("node-agent", "mcp-node-agent"):
        node_modules = Path("examples") / example / "node_modules"
        if (ROOT / node_modules).is_dir() and (copy / node_modules).parent.is_dir():
            (copy / node_modules).symlink_to(ROOT / node_modules, target_is_directory=True)
    return copy


@pytest.fixture(scope="module")
def fresh_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return copy_repository(tmp_path_factory.mktemp("fresh") / "deja")


def test_the_fresh_copy_can_run_the_node_example(fresh_copy: Path) -> None:
    """`make node` installed the TypeScript SDK in the repository; the copy uses it."""
    assert (ROOT / "examples" / "node-agent" / "node_modules").is_dir(), \
        "examples/node-agent/node_modules is not installed: `make node` (make test) installs it"
    assert shutil.which("node") is not None, "node is not installed: `make node` installs it"
    agent = fresh_copy / "examples" / "node-agent"
    assert (agent / "node_modules" / "@anthropic-ai" / "sdk" / "package.json").is_file()
    found = subprocess.run(["node", "--input-type=module", "-e",
                            "import Anthropic from '@anthropic-ai/sdk';"
                            "console.log(typeof Anthropic)"],
                           cwd=agent, capture_output=True, text=True, timeout=60)
    assert found.returncode == 0 and found.stdout.strip() == "function", found.stderr


BLOCKS = [(name, section, commands) for name, text in DOCS.items()
          for section, commands in console_blocks(text)
          if (name, section) not in RUN_ELSEWHERE]


def test_the_console_blocks_have_commands() -> None:
    assert len(BLOCKS) >= 14
    assert sum(len(commands) for _, _, commands in BLOCKS) >= 60
    for (name, section), runner in RUN_ELSEWHERE.items():
        assert any(s == section for s, _ in console_blocks(DOCS[name])), (name, section)
        assert (ROOT / runner).is_file()


def block_id(name: str, section: str) -> str:
    return re.sub(r"\W+", "-", f"{Path(name).stem} {section}").strip("-").lower()


@pytest.mark.parametrize("index", range(len(BLOCKS)),
                         ids=[block_id(name, section) for name, section, _ in BLOCKS])
def test_every_console_block_runs_as_written(index: int, fresh_copy: Path,
                                             tmp_path: Path) -> None:
    name, section, commands = BLOCKS[index]
    section = f"{name}, {section}"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DEJA_", "ANTHROPIC_"))}  # a new user: no key, no settings
    env.update(PATH=f"{Path(sys.executable).parent}:{env['PATH']}",
               DEJA_HOME=str(fresh_copy / ".home"), COLUMNS="160", NO_COLOR="1")
    run_block(commands, fresh_copy, env, tmp_path / "out", where=section)


def run_block(commands: list[tuple[str, list[str]]], cwd: Path, env: dict[str, str],
              marks: Path, *, where: str, timeout: float = 600) -> str:
    """Run a console block's commands in ``cwd`` (:func:`block_script`) and check that each
    exits as its comment says and prints the lines shown; what each printed, for a
    caller's own message."""
    marks.mkdir()
    done = subprocess.run(["bash", "-c", block_script(commands, marks)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)
    outputs = [(marks / f"{n}.out").read_text() if (marks / f"{n}.out").exists() else ""
               for n in range(len(commands))]
    said = "\n".join(f"$ {c}\n{o[-2000:]}" for (c, _), o in zip(commands, outputs, strict=True))
    assert done.returncode == 0, f"{where}: {done.stdout}{done.stderr}\n{said}"
    for (command, expected), output in zip(commands, outputs, strict=True):
        flat = " ".join(output.split())
        missing = [line for line in expected if not line_pattern(line).search(flat)]
        assert not missing, (f"{where}: `{command}` did not print {missing}; it "
                             f"printed:\n{output}")
    return said


def test_make_demo_runs_offline_on_a_fresh_copy(fresh_copy: Path) -> None:
    """`make demo`, literally, in a fresh copy (with this suite's virtualenv, so nothing is
    installed again): record, replay offline, verify, show."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DEJA_", "ANTHROPIC_"))}
    env["VENV"] = str(Path(sys.executable).parent.parent)
    env["HOME"] = str(fresh_copy / "user-home")  # the demo signs with the user's own key
    stamp = Path(env["VENV"]) / ".deja-installed"  # -o: never remade, whatever its age
    proc = subprocess.run(["make", "-o", str(stamp), "demo"], cwd=fresh_copy, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "pip install" not in proc.stdout  # the stamp was fresh: nothing installed
    assert "identical" in proc.stdout
    assert "verified with key" in proc.stdout
    assert "stopped by the harness" in proc.stdout  # the loop guard ended the spiral
    assert "loop_detected" in proc.stdout
    assert (fresh_copy / "user-home" / ".deja" / "key").exists()  # ~/.deja/key
    # ... so what the user types next (the README's commands) trusts the demo's cassettes
    shown = subprocess.run([sys.executable, "-m", "deja", "show",
                            "cassettes/demo/retry_spiral.jsonl"], cwd=fresh_copy, env=env,
                           capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert "NOT VERIFIED" not in shown.stdout + shown.stderr and \
        "without your key" not in shown.stdout + shown.stderr, shown


def test_help_texts_name_the_exit_statuses() -> None:
    result = CliRunner().invoke(main, ["replay", "--help"])
    assert "Exit 0 identical, 1 diverged, 2 bad cassette" in " ".join(result.output.split())


def test_the_ci_recipe_replays_with_the_key_as_a_secret() -> None:
    """examples/ci/replay-incidents.yml: a workflow GitHub can read, that runs the marked
    tests with the signing key from the repository's secrets and no model API key."""
    import yaml

    recipe = ROOT / "examples" / "ci" / "replay-incidents.yml"
    flow = yaml.safe_load(recipe.read_text())
    [job] = flow["jobs"].values()
    steps = {s.get("name") or s.get("uses"): s for s in job["steps"]}
    replay = steps["Replay the incidents"]
    assert replay["run"].startswith("pytest ")
    assert replay["env"]["DEJA_KEY"] == "${{ secrets.DEJA_KEY }}"
    assert not [k for k in replay["env"] if k.endswith("_API_KEY")]
    assert "examples/ci/replay-incidents.yml" in README
