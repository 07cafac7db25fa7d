"""Waiting for something another process does, in tests: poll a condition with a generous deadline
(a deadline only turns a hang into a failure; no test asserts how long anything took)."""

import time
from collections.abc import Callable


def wait_until(condition: Callable[[], bool], timeout_s: float = 60.0, interval_s: float = 0.1) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the condition never held in {timeout_s} s")
        time.sleep(interval_s)
