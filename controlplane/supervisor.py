"""The embedded deployment's process supervisor: one gateway and N engine workers on this machine,
and timers for the periodic work (`serve` runs the autoscaler and the local node agent on them).

Children die with the supervisor (PR_SET_PDEATHSIG), a child that exits unexpectedly is logged
and restarted with a growing delay, and SIGINT/SIGTERM stop everything. A child that exits with
code 0 was asked to stop (a worker told to shut down by the control plane) and is left stopped.

Stopping goes in stages, lowest `stop_stage` first, because children depend on each other while
they stop (an engine worker finishing its KV store writes needs the store's index, kept by another
child). A stage's children get SIGTERM, whatever of them has not exited after a grace period gets
SIGKILL, then the stage's own stopping work runs (StopStep: a node agent ending the workers it
started), and only then does the next stage begin. An exception in `run` stops the children too.
"""

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
RESTART_DELAYS = (1.0, 2.0, 5.0, 10.0, 30.0)
STABLE_AFTER = 60.0  # a child that ran this long has its restart delay reset
GRACE_PERIOD = 10.0
# Where the code this supervisor runs was imported from (a checkout, or site-packages once installed).
SOURCE_ROOT = str(Path(__file__).resolve().parents[1])


def _die_with_parent() -> None:
    """Runs in the child between fork and exec: ask the kernel for SIGTERM when the parent dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


@dataclass
class Child:
    name: str
    argv: Sequence[str]
    env: dict[str, str]
    process: subprocess.Popen | None = None
    started_at: float = 0.0
    restarts: int = 0
    restart_at: float | None = None
    exit_codes: list[int] = field(default_factory=list)
    stopped: bool = False  # exited with code 0: not to be restarted
    stop_stage: int = 0  # stops once every child and StopStep of a lower stage is done

    def start(self) -> None:
        self.process = subprocess.Popen(self.argv, env=self.env, preexec_fn=_die_with_parent)
        self.started_at = time.monotonic()
        self.restart_at = None
        log.info("started %s (pid %d)", self.name, self.process.pid)


@dataclass
class Timer:
    """Periodic work of the supervisor's own (the autoscaler's tick, the local node agent's round).
    The first run is one interval after the start; one that raises is logged and runs again later."""

    name: str
    interval_s: float
    run: Callable[[], object]
    due_at: float = 0.0


@dataclass(frozen=True)
class StopStep:
    """Stopping work of the supervisor's own, done in `stage` once that stage's children exited (a
    node agent ending the workers it started, which are no children of the supervisor's)."""

    stage: int
    run: Callable[[], object]


class Supervisor:
    def __init__(
        self, children: Sequence[Child], timers: Sequence[Timer] = (), stop_steps: Sequence[StopStep] = ()
    ) -> None:
        self.children = list(children)
        self.timers = list(timers)
        self.stop_steps = list(stop_steps)
        self.stopping = False

    def listen_for_stop(self) -> None:
        """From now on SIGINT and SIGTERM ask this supervisor to stop (run calls it too). A caller that
        says it is ready before run, as serve's banner does, calls it first: a Ctrl-C right after the
        banner would otherwise raise wherever the main thread is."""
        signal.signal(signal.SIGINT, self._request_stop)
        signal.signal(signal.SIGTERM, self._request_stop)

    def run(self) -> int:
        """Start the children and keep them running until a signal asks to stop; returns the exit code.
        A stop asked before or while they start starts no more of them."""
        self.listen_for_stop()
        try:
            for child in self.children:
                if self.stopping:
                    break
                child.start()
            for timer in self.timers:
                timer.due_at = time.monotonic() + timer.interval_s
            while not self.stopping:
                self._tend(time.monotonic())
                self._run_timers(time.monotonic())
                time.sleep(0.2)
        finally:
            self._stop_all()
        return 0

    def _run_timers(self, now: float) -> None:
        for timer in self.timers:
            if now < timer.due_at:
                continue
            timer.due_at = now + timer.interval_s
            try:
                timer.run()
            except Exception:
                log.exception("%s failed", timer.name)

    def _request_stop(self, signum: int, frame: object) -> None:
        self.stopping = True

    def _tend(self, now: float) -> None:
        for child in self.children:
            if child.stopped:
                continue
            if child.restart_at is not None:
                if now >= child.restart_at:
                    child.start()
                continue
            code = child.process.poll()
            if code is None:
                continue
            child.exit_codes.append(code)
            if code == 0:
                child.stopped = True
                log.warning("%s exited with code 0 (asked to stop); not restarting it", child.name)
                continue
            if now - child.started_at >= STABLE_AFTER:
                child.restarts = 0
            delay = RESTART_DELAYS[min(child.restarts, len(RESTART_DELAYS) - 1)]
            child.restarts += 1
            child.restart_at = now + delay
            log.error("%s exited with code %d; restarting in %.0fs", child.name, code, delay)

    def _stop_all(self) -> None:
        stages = {child.stop_stage for child in self.children} | {step.stage for step in self.stop_steps}
        for stage in sorted(stages):
            self._stop_stage(stage)

    def _stop_stage(self, stage: int) -> None:
        running = [
            child.process
            for child in self.children
            if child.stop_stage == stage and child.process is not None and child.process.poll() is None
        ]
        for process in running:
            process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + GRACE_PERIOD
        for process in running:
            try:
                process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                log.warning("pid %d did not stop in %.0fs; killing it", process.pid, GRACE_PERIOD)
                process.kill()
                process.wait()
        for step in self.stop_steps:
            if step.stage == stage:
                try:
                    step.run()
                except Exception:
                    log.exception("stopping (stage %d) failed", stage)


def child_env(**overrides: str) -> dict[str, str]:
    env = dict(os.environ)
    # Children start with `python -m`, which imports from the working directory first: this puts the
    # supervisor's own code ahead, so a checkout started from elsewhere runs the same code in every process.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [SOURCE_ROOT, env.get("PYTHONPATH")]))
    env.update(overrides)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def management_command(*args: str) -> list[str]:
    """The command line of a child that runs one of Django's management commands."""
    return [sys.executable, "-m", "controlplane.manage", *args]
