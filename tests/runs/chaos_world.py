"""The processes and disks of one chaos cell: ``deja serve``, ``deja worker``, a Postgres
server of the cell's own, small tmpfs disks that can be filled, and the processes a run
is made of.

- :class:`Service` is a long-lived process (``deja serve`` on a fixed port, ``deja
  worker --jobs N``) in a session of its own, so that its process group is its agents'
  too; it can be killed alone or with its group and started again with the same
  arguments, as a supervisor would.
- :class:`Postgres` is a throwaway cluster whose directory the cell chooses (a tmpfs to
  fill, for a full database disk), stopped and started again on the same data, or killed
  with SIGKILL (postmaster and backends) and started again (crash recovery).
- :class:`Tmpfs` mounts a small tmpfs (root only), fills it to the last byte with a filler
  file and frees it.
- :class:`World` is one cell's: its folders, disks, database, server and worker, a
  supervisor thread that starts again what exits on its own, and the clients (``deja
  submit``, ``deja runs``, ``deja status``, ``deja verify`` in this process; ``GET /runs``).
- :func:`run_processes` finds a run's ``deja record`` / ``deja resume`` launcher (its
  command line names the run's cassette) and the agent under it (the launcher's child).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from chaos_cells import Cell, Settings
from click.testing import CliRunner
from pg_server import SETTINGS, find_binaries
from runs_helpers import base_env

from deja.cli import main as cli_main

PYTHON = sys.executable
AGENT = Path(__file__).resolve().parent / "chaos_agent.py"
_cli_lock = threading.Lock()
START_TIMEOUT = 60.0  # for a service to say it is up (busy machine)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie is not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def _ppid_and_cmdline(pid: str) -> tuple[int, bytes] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            cmdline = fh.read()
    except (OSError, IndexError):
        return None
    if fields[0] == b"Z":
        return None
    return int(fields[1]), cmdline


def run_processes(cassette: Path) -> tuple[int | None, list[int]]:
    """The live launcher of the run writing ``cassette`` (``python -m deja record -o
    CASSETTE`` or ``python -m deja resume CASSETTE``) and its children (the agent)."""
    needle = str(cassette).encode()
    table: dict[int, tuple[int, bytes]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            found = _ppid_and_cmdline(name)
            if found is not None:
                table[int(name)] = found
    launcher = None
    for pid, (_, cmdline) in table.items():
        args = cmdline.split(b"\0")
        if needle in args and b"deja" in args and (b"record" in args or b"resume" in args):
            launcher = pid
            break
    if launcher is None:
        return None, []
    return launcher, [pid for pid, (ppid, _) in table.items() if ppid == launcher]


def sigkill(pid: int) -> bool:
    try:
        os.kill(pid, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False


class Service:
    """A long-lived ``python -m deja ARGS`` process, leader of its own session; its
    output goes to a log file per launch."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], logs: Path,
                 ready: str | Path) -> None:
        self.name, self.args, self.env, self.logs = name, args, env, logs
        self.ready = ready  # a line its log says once up, or a file it writes then
        self.launches = 0
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = logs / f"{name}-0.log"

    def start(self, wait: bool = True) -> Service:
        self.logs.mkdir(parents=True, exist_ok=True)
        self.log_path = self.logs / f"{self.name}-{self.launches}.log"
        self.launches += 1
        if isinstance(self.ready, Path):
            self.ready.unlink(missing_ok=True)
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen([PYTHON, "-m", "deja", *self.args], env=self.env,
                                            stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        if wait:
            self.wait_up()
        return self

    def log(self) -> str:
        return "".join(f"--- {p.name}\n" + p.read_text(errors="replace")
                       for p in sorted(self.logs.glob(f"{self.name}-*.log")))

    def up(self) -> bool:
        if isinstance(self.ready, Path):
            return self.ready.is_file()
        return self.ready in self.log_path.read_text(errors="replace")

    def wait_up(self, timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while not self.up():
            if not self.alive():
                raise RuntimeError(f"{self.name} exited at start "
                                   f"({self.exit_code()}):\n{self.log()[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} not up after {timeout:.0f} s:\n"
                                   f"{self.log()[-3000:]}")
            time.sleep(0.05)

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def exit_code(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def kill(self) -> None:
        """SIGKILL the process alone (its children live on until their parent-death
        signal ends them)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def kill_group(self) -> None:
        """SIGKILL its whole process group (what an OOM kill of a cgroup, or ``kill -9
        -PGID``, does): it and every agent under it, none with time to write a line."""
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL to the group; whatever is left of its session goes too."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.kill_group()
        sid = self.pid
        for pid in os.listdir("/proc"):
            if pid.isdigit() and _session(pid) == sid:
                sigkill(int(pid))


def _session(pid: str) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return int(fh.read().rsplit(b")", 1)[1].split()[3])
    except (OSError, IndexError, ValueError):
        return None


class Tmpfs:
    """A tmpfs of ``size_mb`` mounted at ``path`` (root only), which :meth:`fill` fills
    to the last byte with a filler file and :meth:`free` empties again."""

    def __init__(self, path: Path, size_mb: int, owner: str | None = None) -> None:
        self.path = path
        self.filler = path / ".chaos-filler"
        path.mkdir(parents=True, exist_ok=True)
        if os.geteuid() != 0:
            raise RuntimeError("a full disk is a tmpfs of its own, and mounting one needs "
                               "root: run the chaos table as root (CI does)")
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=0755", "tmpfs",
                        str(path)], check=True, capture_output=True)
        if owner is not None:
            user = pwd.getpwnam(owner)
            os.chown(path, user.pw_uid, user.pw_gid)

    def fill(self) -> int:
        """Write the filler until the disk is full; the bytes written."""
        written = 0
        with self.filler.open("ab", buffering=0) as fh:
            for chunk in (1 << 20, 1 << 12, 1):
                block = b"\0" * chunk
                while True:
                    try:
                        written += fh.write(block) or 0
                    except OSError as exc:
                        if exc.errno != errno.ENOSPC:
                            raise
                        break
        return written

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)

    def unmount(self) -> None:
        for args in (["umount", str(self.path)], ["umount", "-l", str(self.path)]):
            if subprocess.run(args, capture_output=True).returncode == 0:
                return


class Postgres:
    """A throwaway PostgreSQL cluster under ``root`` (which may be a tmpfs), on a free
    port of 127.0.0.1, with the database ``deja``; under root it runs as ``postgres``."""

    def __init__(self, root: Path) -> None:
        self.bin = find_binaries()
        self.root = root
        self.data = root / "data"
        self.sock = root / "run"
        self.port = free_port()
        self.user = pwd.getpwnam("postgres") if os.geteuid() == 0 else None
        self.log = root / "postgres.log"

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/deja"

    def _run(self, *argv: str) -> subprocess.CompletedProcess[str]:
        command = [str(self.bin / argv[0]), *argv[1:]]
        if self.user is not None:
            command = ["runuser", "-u", "postgres", "--", *command]
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        env["LC_ALL"] = "C"
        return subprocess.run(command, env=env, cwd=self.root, capture_output=True, text=True,
                              timeout=START_TIMEOUT + 30, check=False)

    def create(self) -> Postgres:
        self.root.mkdir(parents=True, exist_ok=True)
        self.sock.mkdir(exist_ok=True)
        if self.user is not None:
            for path in (self.root, self.sock):
                os.chown(path, self.user.pw_uid, self.user.pw_gid)
        done = self._run("initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust",
                         "-E", "UTF8", "--locale=C", "--no-sync", "--no-instructions")
        if done.returncode != 0:
            raise RuntimeError(f"initdb failed: {done.stdout}{done.stderr}")
        settings = {**SETTINGS, "unix_socket_directories": f"'{self.sock}'",
                    "min_wal_size": "32MB", "max_wal_size": "64MB", "port": str(self.port)}
        with (self.data / "postgresql.conf").open("a") as conf:
            conf.writelines(f"{k} = {v}\n" for k, v in settings.items())
        self.start()
        done = self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U",
                         "postgres", "deja")
        if done.returncode != 0:
            raise RuntimeError(f"createdb failed: {done.stdout}{done.stderr}")
        return self

    def start(self) -> bool:
        """Start the server on its data (after a stop, a kill or a crash); whether it
        came up."""
        done = self._run("pg_ctl", "start", "-D", str(self.data), "-l", str(self.log),
                         "-w", "-t", str(int(START_TIMEOUT)))
        return done.returncode == 0

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "stop", "-D", str(self.data), "-m", mode, "-w")

    def postmaster(self) -> int | None:
        try:
            pid = int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        return pid if alive(pid) else None

    def kill(self) -> int:
        """SIGKILL the postmaster and every backend (a crash of the database host's
        service); the processes killed."""
        master = self.postmaster()
        if master is None:
            return 0
        killed = [master] if sigkill(master) else []
        for pid in os.listdir("/proc"):
            found = _ppid_and_cmdline(pid) if pid.isdigit() else None
            if found is not None and found[0] == master and sigkill(int(pid)):
                killed.append(int(pid))
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in killed) and time.monotonic() < deadline:
            time.sleep(0.05)
        return len(killed)

    def destroy(self) -> None:
        if self.postmaster() is not None:
            self.stop("immediate")
        if self.postmaster() is not None:
            self.kill()
        shutil.rmtree(self.data, ignore_errors=True)


class World:
    """The processes and folders of one cell."""

    def __init__(self, cell: Cell, folder: Path, settings: Settings, stub_url: str) -> None:
        self.cell, self.folder, self.settings = cell, folder, settings
        self.home, self.cassettes = folder / "home", folder / "cassettes"
        self.ledger, self.logs = folder / "ledger.jsonl", folder / "logs"
        self.token = "chaos-" + os.urandom(12).hex()
        self.url = f"http://127.0.0.1:{free_port()}"
        self.stub_url = stub_url
        self.mounts: list[Tmpfs] = []
        self.disk: Tmpfs | None = None
        self.pg: Postgres | None = None
        self.pg_root: Path | None = None
        self.db_url = ""
        self.env: dict[str, str] = {}
        self.down: set[str] = set()  # what a fault holds down: the supervisor leaves it
        self.restarts: collections.Counter[str] = collections.Counter()
        self.lock = threading.RLock()
        self.stopping = threading.Event()
        self.supervisor: threading.Thread | None = None
        self.services: dict[str, Service] = {}

    def setup(self) -> None:
        for d in ("home", "cassettes", "db", "logs"):
            (self.folder / d).mkdir(parents=True, exist_ok=True)
        pg_root = self.folder / "pg"
        if self.cell.store == "Postgres":  # where the postgres user can enter
            pg_root = self.pg_root = Path(tempfile.mkdtemp(prefix="deja-chaos-pg-", dir="/tmp"))
        if self.cell.disk is not None:
            pg = self.cell.disk == "pg"
            where = pg_root if pg else self.folder / self.cell.disk
            self.disk = Tmpfs(where, 192 if pg else 48,
                              owner="postgres" if pg and os.geteuid() == 0 else None)
            self.mounts.append(self.disk)
        if self.cell.store == "Postgres":
            self.pg = Postgres(pg_root).create()
            db_url = self.pg.url
        else:
            db_url = f"sqlite:///{self.folder / 'db' / 'runs.sqlite'}"
        self.db_url = db_url
        self.env = base_env(self.home, DEJA_CASSETTE_DIR=str(self.cassettes),
                            DEJA_DATABASE_URL=db_url, DEJA_SERVER=self.url,
                            DEJA_TOKEN=self.token, ANTHROPIC_BASE_URL=self.stub_url,
                            CHAOS_LEDGER=str(self.ledger),
                            CHAOS_DELAY=str(self.settings.delay),
                            CHAOS_INVOICES=str(self.settings.invoices))
        port = self.url.rsplit(":", 1)[1]
        ready = self.folder / "serve.ready"
        self.services["server"] = Service(
            "serve", ["serve", "--port", port, "--quiet", "--ready-file", str(ready)],
            self.env, self.logs, ready).start()
        self.services["worker"] = Service(
            "worker", ["worker", "--id", "w1", "--jobs", str(self.settings.jobs)],
            self.env, self.logs, "worker w1 is up").start()
        self.supervisor = threading.Thread(target=self._supervise, daemon=True)
        self.supervisor.start()

    def _supervise(self) -> None:
        """Start again what exited on its own (at most every 2 s each)."""
        last: dict[str, float] = {}
        while not self.stopping.wait(0.5):
            with self.lock:
                now = time.monotonic()
                for name, service in self.services.items():
                    if name in self.down or service.alive() or now - last.get(name, 0) < 2:
                        continue
                    self.restarts[f"{name} exited {service.exit_code()}"] += 1
                    last[name] = now
                    service.start(wait=False)
                if self.pg is not None and "database" not in self.down and \
                        self.pg.postmaster() is None and now - last.get("database", 0) >= 2:
                    self.restarts["Postgres stopped"] += 1
                    last["database"] = now
                    self.pg.start()

    def teardown(self) -> None:
        self.stopping.set()
        if self.supervisor is not None:
            self.supervisor.join(10)
        for service in self.services.values():
            service.stop()
        if self.pg is not None:
            self.pg.destroy()
        for mount in self.mounts:
            mount.unmount()
        if self.pg_root is not None:
            shutil.rmtree(self.pg_root, ignore_errors=True)

    # -- talking to it

    def cli(self, *args: str) -> Any:
        """``deja ARGS`` in this process, with the cell's environment (one at a time: the
        runner swaps the process's environment and standard streams while it runs)."""
        with _cli_lock:
            return CliRunner().invoke(cli_main, list(args), env=self.env)

    def submit(self, count: int) -> list[str]:
        ids = []
        for _ in range(count):
            done = self.cli("submit", "--json", "--label", f"chaos={self.cell.name}", "--cwd",
                            str(self.folder), "--", PYTHON, str(AGENT))
            assert done.exit_code == 0, f"deja submit: {done.output}"
            ids.append(json.loads(done.stdout)["run_id"])
        return ids

    def api(self, path: str) -> tuple[int | None, Any]:
        """GET ``path`` of deja serve: (HTTP status, JSON body), (None, why) unreachable."""
        request = urllib.request.Request(self.url + path, headers={
            "authorization": f"Bearer {self.token}", "accept": "application/json"})
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(request, timeout=10) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            with exc:
                body = exc.read()
            with contextlib.suppress(ValueError):
                return exc.code, json.loads(body)
            return exc.code, body.decode(errors="replace")
        except (OSError, ValueError) as exc:
            return None, str(exc)

    def statuses(self) -> dict[str, str] | None:
        code, body = self.api(f"/runs?label=chaos={self.cell.name}&limit=1000")
        if code != 200 or not isinstance(body, dict):
            return None
        return {r["run_id"]: r["status"] for r in body.get("runs", [])}

    def cassette(self, run: str) -> Path:
        return self.cassettes / f"{run}.jsonl"
