"""Warm starts: a program run as a fork of a fork server behaves as a fresh interpreter would.

Each test starts a real fork server (:class:`recorder.harness.warm_pool.WarmPool`) and runs
real programs through it; what a program sees and how it ends are compared with what the
same command does as a fresh ``python`` process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from recorder.harness.warm_pool import WarmPool

# A module whose import is seen: it appends a line to $IMPORTS each time it is imported.
COUNTED = 'import os\nwith open(os.environ["IMPORTS"], "a") as f:\n    f.write("imported\\n")\n'

SEES = '''\
import atexit, json, os, sys, threading, time
import counted

def late():
    time.sleep(0.3)
    print("thread finished", flush=True)

atexit.register(lambda: print("atexit ran", flush=True))
threading.Thread(target=late).start()  # not a daemon: the program waits for it
print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(),
                  "env": os.environ.get("WARM_TEST"), "name": __name__,
                  "stdin": sys.stdin.read(), "in_path": os.environ.get("PYTHONPATH")}))
'''

ENDINGS = {
    "ok": ("pass", 0),
    "exit3": ("import sys; sys.exit(3)", 3),
    "exit_text": ("import sys; sys.exit('bad input')", 1),
    "raises": ("raise ValueError('the program broke')", 1),
    "interrupted": ("raise KeyboardInterrupt", -signal.SIGINT),
}


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[WarmPool, Path]]:
    lib = tmp_path_factory.mktemp("lib")
    (lib / "counted.py").write_text(COUNTED)
    imports = lib / "imports.txt"
    saved = dict(os.environ)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(lib), *[p for p in saved.get("PYTHONPATH", "").split(os.pathsep) if p]])
    os.environ["IMPORTS"] = str(imports)
    try:
        with WarmPool(["counted"]) as server:
            yield server, lib
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _run(pool: WarmPool, argv: list[str], cwd: Path, **env: str
         ) -> tuple[int, str, str]:
    err = cwd / "stderr.txt"
    with err.open("w+b") as stream:
        child = pool.start(argv, cwd=str(cwd), stderr=stream, env={**os.environ, **env})
        assert child is not None
        out, _ = child.communicate()
        stream.seek(0)
        return child.returncode or 0, out.decode(), stream.read().decode()


def test_a_forked_program_sees_what_a_fresh_one_sees(pool, tmp_path: Path) -> None:
    server, _ = pool
    script = tmp_path / "app" / "sees.py"
    script.parent.mkdir()
    script.write_text(SEES)
    argv = [sys.executable, str(script), "--flag", "x"]
    code, out, err = _run(server, argv, tmp_path, WARM_TEST="yes")
    fresh = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=60,
                           stdin=subprocess.DEVNULL, env={**os.environ, "WARM_TEST": "yes"})
    assert (code, err) == (fresh.returncode, fresh.stderr) == (0, "")
    assert out == fresh.stdout
    seen = json.loads(out.splitlines()[0])
    assert seen["argv"] == [str(script), "--flag", "x"]
    assert seen["path0"] == str(script.parent)
    assert seen["cwd"] == str(tmp_path)
    assert seen["env"] == "yes" and seen["name"] == "__main__" and seen["stdin"] == ""
    # the thread was waited for, then the exit functions ran, as at an interpreter's end
    assert out.splitlines()[1:] == ["thread finished", "atexit ran"]


def test_a_module_run_with_dash_m_finds_its_package_from_the_working_directory(
        pool, tmp_path: Path) -> None:
    server, _ = pool
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "tool.py").write_text(
        "import sys\nprint(__name__, sys.argv[1:], sys.path[0])\n")
    code, out, _ = _run(server, [sys.executable, "-m", "pkg.tool", "a"], tmp_path)
    assert code == 0
    assert out.split() == ["__main__", "['a']", str(tmp_path)]


@pytest.mark.parametrize("ending", sorted(ENDINGS))
def test_a_forked_program_ends_as_an_interpreter_does(pool, tmp_path: Path,
                                                       ending: str) -> None:
    server, _ = pool
    source, expected = ENDINGS[ending]
    script = tmp_path / "ends.py"
    script.write_text(source + "\n")
    code, _, err = _run(server, [sys.executable, str(script)], tmp_path)
    fresh = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                           timeout=60)
    assert code == fresh.returncode == expected
    assert err.splitlines()[-1:] == fresh.stderr.splitlines()[-1:]


def test_preloaded_modules_are_imported_once_for_every_program(pool, tmp_path: Path) -> None:
    server, lib = pool
    script = tmp_path / "uses.py"
    script.write_text("import counted\n")
    before = (lib / "imports.txt").read_text().count("imported")  # the server's (and fresh runs')
    for _ in range(3):
        assert _run(server, [sys.executable, str(script)], tmp_path)[0] == 0
    assert (lib / "imports.txt").read_text().count("imported") == before


def test_commands_a_fork_cannot_start_are_left_to_start_cold(pool, tmp_path: Path) -> None:
    server, _ = pool
    for argv in ([sys.executable, "-X", "dev", "x.py"], [sys.executable, "-c", "pass"],
                 [sys.executable, "-I", "x.py"], ["/bin/echo", "hi"], [sys.executable]):
        assert server.start(argv, cwd=str(tmp_path), stderr=2) is None


def _wait_for(check, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (ended, not yet reaped) counts as gone
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().split(") ")[-1][:1] != "Z"


SLEEPER = ('import os, sys, time\nopen(sys.argv[1], "w").write(str(os.getpid()))\n'
           'time.sleep(600)\n')


def test_a_caller_that_goes_away_gets_its_program_stopped(pool, tmp_path: Path) -> None:
    server, _ = pool
    script, mark = tmp_path / "sleeper.py", tmp_path / "pid"
    script.write_text(SLEEPER)
    child = server.start([sys.executable, str(script), str(mark)], cwd=str(tmp_path),
                         stderr=2)
    assert child is not None
    _wait_for(mark.exists, "the program to start")
    assert int(mark.read_text()) == child.pid and _alive(child.pid)
    child._conn.close()  # the caller is gone (as when its process dies)
    child.stdout.close()
    _wait_for(lambda: not _alive(child.pid), "the program to be stopped")


def test_a_program_dies_with_its_fork_server(tmp_path: Path) -> None:
    script, mark = tmp_path / "sleeper.py", tmp_path / "pid"
    script.write_text(SLEEPER)
    server = WarmPool([])
    try:
        child = server.start([sys.executable, str(script), str(mark)], cwd=str(tmp_path),
                             stderr=2)
        assert child is not None
        _wait_for(mark.exists, "the program to start")
        server._server.kill()  # SIGKILL: no chance to stop anything itself
        _wait_for(lambda: not _alive(child.pid), "the program to die with its server")
        assert child.wait(30) == -signal.SIGKILL
        child.stdout.close()
    finally:
        server.close()


def test_a_pool_outlives_the_thread_that_started_it(tmp_path: Path) -> None:
    """A worker starts its pool in the thread of its first job, which may end first; a
    parent-death signal tied to that thread would stop the server with it."""
    import threading

    made: list[WarmPool] = []
    ids: list[int] = []
    starter = threading.Thread(target=lambda: (ids.append(threading.get_native_id()),
                                               made.append(WarmPool([]))))
    starter.start()
    starter.join()
    server = made[0]
    try:
        script = tmp_path / "ok.py"
        script.write_text("print('still here')\n")
        # the starting thread is gone from the OS too: a death signal would be sent by now
        _wait_for(lambda: not Path(f"/proc/self/task/{ids[0]}").exists(), "the thread's end")
        with pytest.raises(subprocess.TimeoutExpired):  # still running, as it must be
            server._server.wait(0.5)
        code, out, _ = _run(server, [sys.executable, str(script)], tmp_path)
        assert (code, out) == (0, "still here\n")
    finally:
        server.close()


def test_polling_from_another_thread_does_not_disturb_the_waiting_one(
        pool, tmp_path: Path) -> None:
    """A worker polls the children it runs (to forget those that ended) while each job's
    thread waits for its own: neither may take the other's answer."""
    import threading

    server, _ = pool
    script = tmp_path / "slowish.py"
    script.write_text("import sys, time\ntime.sleep(0.5)\nsys.exit(7)\n")
    child = server.start([sys.executable, str(script)], cwd=str(tmp_path), stderr=2)
    assert child is not None
    seen: list[int | None] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            seen.append(child.poll())

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        child.communicate()
    finally:
        stop.set()
        poller.join()
    assert child.returncode == 7
    assert set(seen) <= {None, 7} and None in seen
