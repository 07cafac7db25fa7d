"""The embedded supervisor's restart rule: a crashed child is restarted, one that exited with code 0
(asked to stop, e.g. a worker shut down by the control plane) is left stopped."""

import sys

import pytest

from controlplane.supervisor import RESTART_DELAYS, Child, Supervisor


def exited_child(name: str, script: str) -> Child:
    child = Child(name=name, argv=[sys.executable, "-c", script], env={})
    child.start()
    child.process.wait()
    return child


def test_a_child_that_exits_with_code_zero_is_logged_and_left_stopped(caplog):
    child = exited_child("done", "raise SystemExit(0)")
    process = child.process
    supervisor = Supervisor([child])

    supervisor._tend(child.started_at + 1)
    supervisor._tend(child.started_at + 1000)

    assert child.stopped and child.restart_at is None
    assert child.process is process and child.exit_codes == [0]
    assert "done exited with code 0" in caplog.text


@pytest.mark.parametrize(
    ("script", "code"),
    [("raise SystemExit(3)", 3), ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -9)],
    ids=["exit-3", "sigkill"],
)
def test_a_child_that_crashes_is_restarted_after_a_delay(caplog, script, code):
    child = exited_child("crashy", script)
    first = child.process
    supervisor = Supervisor([child])

    supervisor._tend(child.started_at)
    assert child.restart_at == pytest.approx(child.started_at + RESTART_DELAYS[0])
    supervisor._tend(child.restart_at)

    assert not child.stopped and child.process is not first and child.exit_codes == [code]
    assert f"crashy exited with code {code}; restarting" in caplog.text
    child.process.wait()
