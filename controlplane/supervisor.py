"""The embedded deployment's process supervisor: one gateway and N engine workers on this machine.

Children die with the supervisor (PR_SET_PDEATHSIG), a child that exits unexpectedly is logged
and restarted with a growing delay, and SIGINT/SIGTERM stop everything: SIGTERM to each child,
then SIGKILL to whatever has not exited after a grace period. A child that exits with code 0 was
asked to stop (a worker told to shut down by the control plane) and is left stopped.
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

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
RESTART_DELAYS = (1.0, 2.0, 5.0, 10.0, 30.0)
STABLE_AFTER = 60.0  # a child that ran this long has its restart delay reset
GRACE_PERIOD = 10.0


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

    def start(self) -> None:
        self.process = subprocess.Popen(self.argv, env=self.env, preexec_fn=_die_with_parent)
        self.started_at = time.monotonic()
        self.restart_at = None
        log.info("started %s (pid %d)", self.name, self.process.pid)


@dataclass
class PeriodicJob:
    """Work the embedded default runs on a timer in the supervisor (Celery beat's job with a broker).
    A job that raises is logged and runs again at its next time."""

    name: str
    interval_s: float
    run: Callable[[], object]
    next_at: float = 0.0

    def run_if_due(self, now: float) -> None:
        if now < self.next_at:
            return
        self.next_at = now + self.interval_s
        try:
            self.run()
        except Exception:
            log.exception("periodic job %s failed", self.name)


class Supervisor:
    def __init__(self, children: Sequence[Child], periodic: Sequence[PeriodicJob] = ()) -> None:
        self.children = list(children)
        self.periodic = list(periodic)
        self.stopping = False

    def run(self) -> int:
        """Start the children and keep them running until a signal asks to stop; returns the exit code."""
        signal.signal(signal.SIGINT, self._request_stop)
        signal.signal(signal.SIGTERM, self._request_stop)
        for child in self.children:
            child.start()
        while not self.stopping:
            self._tend(time.monotonic())
            for job in self.periodic:
                job.run_if_due(time.monotonic())
            time.sleep(0.2)
        return self._stop_all()

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

    def _stop_all(self) -> int:
        running = [c.process for c in self.children if c.process is not None and c.process.poll() is None]
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
        return 0


def child_env(**overrides: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(overrides)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def manage_py(*args: str) -> list[str]:
    return [sys.executable, os.path.join(os.path.dirname(os.path.dirname(__file__)), "manage.py"), *args]
