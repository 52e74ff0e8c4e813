"""Many processes recording at once into one directory, against one stub server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from conftest import MODEL

import recorder

WORKERS = 16
CALLS = 20

# The workers: one process imports everything once and forks WORKERS processes, which share
# nothing yet but the imported modules (sixteen fresh interpreters would spend most of the
# test importing the SDK). It says "ready" once they all wait for the go, and on "go" (on
# stdin) lets them all go at once; each makes CALLS model calls under record(<shared dir>)
# and prints its run id and cassette path. Last it prints "exit" and their exit statuses.
CHILD = r"""
import os
import sys
import traceback

import anthropic

import recorder

url, out, model, workers, calls = sys.argv[1:6]
calls = int(calls)


def work(worker):
    with recorder.record(out, labels={"worker": worker}) as run:
        with anthropic.Anthropic(base_url=url, api_key="sk-test", max_retries=0) as client:
            for i in range(calls):
                message = client.messages.create(
                    model=model, max_tokens=16,
                    messages=[{"role": "user", "content": f"worker {worker} call {i}"}])
                assert message.content[0].text == f"ok worker {worker} call {i}", message
    os.write(1, f"{run.run_id} {run.path}\n".encode())  # one write: lines never mix


go_read, go_write = os.pipe()
pids = []
for n in range(int(workers)):
    pid = os.fork()
    if pid == 0:
        os.close(go_write)
        os.read(go_read, 1)  # returns when the go closes the pipe: every worker at once
        code = 1
        try:
            work(str(n))
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stderr.flush()
            os._exit(code)
    pids.append(pid)
os.close(go_read)
print("ready", flush=True)
sys.stdin.readline()
os.close(go_write)
codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
print("exit", *codes, flush=True)
"""


def test_sixteen_processes_record_into_one_directory(stub, tmp_path: Path) -> None:
    server = stub({"default": {"text": "ok {echo}"}})
    out = tmp_path / "cassettes"
    out.mkdir()
    env = dict(os.environ, PYTHONWARNINGS="error")
    with subprocess.Popen(
            [sys.executable, "-c", CHILD, server.url, str(out), MODEL, str(WORKERS),
             str(CALLS)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, env=env) as proc:
        try:
            assert proc.stdout is not None and proc.stdin is not None
            line = proc.stdout.readline()
            assert line == "ready\n", (line, proc.stderr.read() if proc.stderr else "")
            started = time.perf_counter()
            proc.stdin.write("go\n")  # all workers go at once
            proc.stdin.flush()
            stdout, stderr = proc.communicate(timeout=60)
            elapsed = time.perf_counter() - started
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    *lines, codes = stdout.splitlines()
    assert proc.returncode == 0 and codes == "exit" + " 0" * WORKERS, (codes, stderr)
    results = [line.split() for line in lines]
    assert len(server.requests) == WORKERS * CALLS

    run_ids = [run_id for run_id, _ in results]
    assert len(set(run_ids)) == WORKERS
    files = sorted(out.iterdir())
    assert len(files) == WORKERS
    assert sorted(p.name for p in files) == sorted(f"{r}.jsonl" for r in run_ids)
    assert sorted(Path(path) for _, path in results) == files

    keyring = recorder.load_keyring(create=False)
    total = 0
    workers_seen = set()
    for path in files:
        cassette = recorder.load(path, keyring=keyring, require_signature=True,
                                 allow_incomplete=False)
        assert cassette.verified, cassette.verify_note
        assert cassette.run == path.stem
        worker = cassette.header["labels"]["worker"]
        workers_seen.add(worker)
        obs = cassette.observations
        assert [o["kind"] for o in obs] == ["model"] * CALLS
        assert [o["seq"] for o in obs] == list(range(CALLS))
        # Each cassette holds its own worker's calls, in its order, and nothing else.
        assert [cassette.request_of(o["seq"])["messages"][0]["content"] for o in obs] == [
            f"worker {worker} call {i}" for i in range(CALLS)]
        assert all(o["response"]["status"] == 200 and o["message_id"] for o in obs)
        assert cassette.end is not None
        assert cassette.end["seq"] == CALLS
        assert cassette.end["status"] == "completed"
        assert cassette.end["totals"]["model_calls"] == CALLS
        lines = path.read_bytes().splitlines()
        assert len(lines) == 1 + CALLS + 1  # header, observations, end
        assert all(json.loads(line) for line in lines)
        total += len(obs) + 1
    assert workers_seen == {str(n) for n in range(WORKERS)}
    assert total == WORKERS * (CALLS + 1)
    assert elapsed < 60
