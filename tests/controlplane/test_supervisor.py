"""The embedded supervisor with real child processes: its restart rule (a crashed child is restarted,
one that exited with code 0, asked to stop, e.g. a worker shut down by the control plane, is left
stopped) and its stop order (stage by stage, each once the one before has exited)."""

import signal
import sys
from pathlib import Path

import pytest

from controlplane.supervisor import RESTART_DELAYS, Child, StopStep, Supervisor
from tests.waiting import wait_until

# A child that marks itself alive and, asked to stop (SIGTERM), writes down which children are alive,
# takes `linger_s` to finish its work, and exits.
STOPPING_CHILD = """
import signal, sys, time
from pathlib import Path
directory, name, linger_s = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3])
def stop(*_):
    (directory / f"{name}.saw").write_text(" ".join(sorted(path.stem for path in directory.glob("*.alive"))))
    time.sleep(linger_s)
    (directory / f"{name}.alive").unlink()
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
(directory / f"{name}.alive").touch()
while True:
    signal.pause()
"""


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


def stopping_child(directory: Path, name: str, stop_stage: int, linger_s: float = 0.0) -> Child:
    argv = [sys.executable, "-c", STOPPING_CHILD, str(directory), name, str(linger_s)]
    return Child(name=name, argv=argv, env={}, stop_stage=stop_stage)


def alive(directory: Path) -> list[str]:
    return sorted(path.stem for path in directory.glob("*.alive"))


def saw(directory: Path, name: str) -> list[str]:
    return (directory / f"{name}.saw").read_text().split()


@pytest.fixture
def signal_handlers_restored():
    """Supervisor.run takes SIGINT and SIGTERM; pytest gets its own handlers back."""
    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def test_children_stop_stage_by_stage_and_a_stop_step_runs_once_its_stage_exited(tmp_path):
    # given an index, a worker and a gateway in stages 2, 1 and 0, the first two slow to stop, and a
    # step of the worker's stage (a node agent ending its own workers)
    index, worker, gateway = (
        stopping_child(tmp_path, "index", 2),
        stopping_child(tmp_path, "worker", 1, linger_s=0.3),
        stopping_child(tmp_path, "gateway", 0, linger_s=0.3),
    )
    seen_by_step = []
    step = StopStep(1, lambda: seen_by_step.append(alive(tmp_path)))
    supervisor = Supervisor([index, worker, gateway], stop_steps=[step])
    for child in supervisor.children:
        child.start()
    wait_until(lambda: len(alive(tmp_path)) == 3)

    # when
    supervisor._stop_all()

    # then each stage was asked to stop only once the one before had exited, and the step ran between
    assert saw(tmp_path, "gateway") == ["gateway", "index", "worker"]
    assert saw(tmp_path, "worker") == ["index", "worker"]
    assert seen_by_step == [["index"]]
    assert saw(tmp_path, "index") == ["index"]
    assert [child.process.returncode for child in (gateway, worker, index)] == [0, 0, 0]


def test_a_child_that_fails_to_start_stops_those_started_before_it(tmp_path, signal_handlers_restored):
    # given a child that runs and one whose program does not exist
    started = stopping_child(tmp_path, "started", 0)
    missing = Child(name="missing", argv=[str(tmp_path / "no-such-program")], env={})

    # when the supervisor runs them
    with pytest.raises(FileNotFoundError):
        Supervisor([started, missing]).run()

    # then the one it had started is not left running
    assert started.process.poll() is not None


def test_ctrl_c_after_the_supervisor_listens_but_before_it_runs_starts_no_child(tmp_path, signal_handlers_restored):
    # given a supervisor listening for stop signals, as serve's is before it prints its banner
    child = stopping_child(tmp_path, "never", 0)
    supervisor = Supervisor([child])
    supervisor.listen_for_stop()

    # when Ctrl-C comes before run (without the handler, KeyboardInterrupt would be raised here)
    signal.raise_signal(signal.SIGINT)
    code = supervisor.run()

    # then it stops at once, having started nothing
    assert code == 0
    assert child.process is None
    assert alive(tmp_path) == []
