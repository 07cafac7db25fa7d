"""The gateway's prepare processes (prepare_process): one child per slot of a FairWorkers, each
driven by its slot's thread over pipes. The thread blocks on the pipe with the GIL released, so the
event loop goes on while a child works.

A child killed for its CPU budget (SIGXCPU) fails its job with a 413 and is replaced at the next
job; one that dies otherwise fails its job with a server error and is replaced too. A child that
cannot start fails each job given to its slot until one can.
"""

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

from django.conf import settings

from controlplane.gateway.errors import GatewayError
from controlplane.gateway.fair_work import FairWorkers
from controlplane.gateway.prepare_jobs import PrepareJob
from controlplane.gateway.prepare_process import READY, read_frame, write_frame
from recipe.api import RequestImage

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
CHILD_COMMAND = [sys.executable, "-m", "controlplane.gateway.prepare_process"]
STOP_TIMEOUT_S = 5


class PrepareProcess:
    """One slot's child: started when the slot opens (so it is warm for the first job), and again
    after it died. Used as the slot's runner: run(job) returns the child's result or raises."""

    def __init__(self, cpu_budget_s: int) -> None:
        self.cpu_budget_s = cpu_budget_s
        self._process: subprocess.Popen | None = None

    def __enter__(self):
        try:
            self._started()
        except RuntimeError:
            log.exception("a prepare process did not start; trying again at its first job")
        return self.run

    def __exit__(self, *exc_info) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        process.stdin.close()  # the child ends at the end of its input
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        process.stdout.close()

    def run(self, job: PrepareJob) -> int | tuple[RequestImage, ...]:
        """count_tokens: the count; a generation, once the child found it valid: its images as the
        child read them."""
        process = self._started()
        try:
            write_frame(process.stdin, (job, self.cpu_budget_s))
            reply = read_frame(process.stdout)
        except (BrokenPipeError, ValueError):  # the child's end of a pipe is gone
            reply = None
        if reply is None:
            self._process = None
            self._fail(process.wait())
        status, *detail = reply
        if status == "error":
            kind, message, param = detail
            raise GatewayError(kind, message, param=param)
        return detail[0]

    def _started(self) -> subprocess.Popen:
        if self._process is None:
            environment = {
                **os.environ,
                "DJANGO_SETTINGS_MODULE": os.environ.get("DJANGO_SETTINGS_MODULE", "controlplane.settings"),
                "SLUICE_MODELS": ",".join(settings.SLUICE_MODELS),
                # One thread of each kind: a job is one request, and the gateway's cores are shared.
                "OMP_NUM_THREADS": "1",
                "RAYON_NUM_THREADS": "1",
                "TOKENIZERS_PARALLELISM": "false",
            }
            process = subprocess.Popen(
                CHILD_COMMAND, cwd=REPO_ROOT, env=environment, stdin=subprocess.PIPE, stdout=subprocess.PIPE
            )
            if read_frame(process.stdout) != READY:
                process.kill()
                raise RuntimeError(f"the prepare process exited with {process.wait()} before it was ready")
            self._process = process
        return self._process

    def _fail(self, returncode: int) -> None:
        if returncode == -signal.SIGXCPU:
            raise GatewayError(
                "request_too_large",
                f"Preparing this request took more than its CPU budget of {self.cpu_budget_s} s; send a smaller one.",
            )
        raise RuntimeError(f"a prepare process exited with {returncode} during a job")


def prepare_pool() -> FairWorkers:
    """SLUICE_PREPARE_PROCESSES children, each job within SLUICE_PREPARE_CPU_BUDGET_S."""
    budget = settings.SLUICE_PREPARE_CPU_BUDGET_S
    return FairWorkers(settings.SLUICE_PREPARE_PROCESSES, lambda: PrepareProcess(budget), name="prepare-process")
