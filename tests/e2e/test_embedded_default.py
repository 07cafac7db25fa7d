"""The embedded default (SQLite, one machine) under `manage.py serve`: it serves, a crashed worker is
restarted and logged, and stopping the supervisor stops every child."""

import os
import signal
import subprocess
import time

import openai
import pytest

from tests.e2e.conftest import MODEL, start_stack, stop_stack

pytestmark = pytest.mark.slow


def children(pid: int) -> dict[int, str]:
    # -ww: whole command lines, however wide (ps cuts them to the terminal width it guesses).
    listed = subprocess.run(
        ["ps", "-ww", "-o", "pid=,args=", "--ppid", str(pid)], capture_output=True, text=True
    ).stdout
    return {int(line.split(None, 1)[0]): line.split(None, 1)[1] for line in listed.strip().splitlines()}


def child_with(pid: int, marker: str, timeout_s: float = 60.0) -> int:
    """The child of `pid` whose command line has `marker` (waiting for it, in case it is restarting)."""
    deadline = time.monotonic() + timeout_s
    while not (found := [child for child, args in children(pid).items() if marker in args]):
        if time.monotonic() > deadline:
            raise AssertionError(f"no child of {pid} runs with {marker!r}: {children(pid)}")
        time.sleep(0.5)
    return found[0]


def chat(stack) -> str:
    reply = stack.openai().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0
    )
    return reply.choices[0].finish_reason


def test_sqlite_stack_restarts_a_killed_worker_and_stops_cleanly(tmp_path):
    process, stack = start_stack(tmp_path, f"sqlite:///{tmp_path / 'embedded.sqlite3'}", "embedded")
    try:
        assert chat(stack) in {"stop", "length"}
        # The default runs a prefill and a decode worker: kill the decode worker.
        worker = child_with(process.pid, "--role=decode")
        os.kill(worker, signal.SIGKILL)

        # Meanwhile the prefill worker runs requests whole, or the gateway answers 503 ("try again
        # shortly"); the restarted worker serves again.
        deadline = time.monotonic() + 120
        while True:
            try:
                assert chat(stack) in {"stop", "length"}
                break
            except openai.InternalServerError as error:
                assert error.status_code == 503
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        assert worker not in [pid for pid, args in children(process.pid).items() if "run_worker" in args]
        assert "decode-0 exited with code -9; restarting" in (tmp_path / "serve.log").read_text()
        running = list(children(process.pid))
    finally:
        stop_stack(process)
    assert process.returncode == 0
    for pid in running:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
