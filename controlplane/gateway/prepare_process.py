"""A prepare process: the gateway's large request bodies are parsed, rendered and tokenized here,
where the work holds no lock the gateway's event loop needs (tokenizers and the recipe's native
conversion hold the GIL for as long as they run: seconds for a body of megabytes).

    python -m controlplane.gateway.prepare_process     (started by prepare_pool, one per slot)

It loads the served models' tokenizers (settings.SLUICE_MODELS), says it is ready, then answers
jobs one at a time on its standard input and output, one frame each way per job (frames, below).
Each job runs within a CPU budget the kernel enforces (RLIMIT_CPU, set afresh per job): a job past
it kills the process with SIGXCPU, whatever code is running, and the pool starts another. Standard
output carries only frames; anything printed goes to standard error. The process ends when its
input closes, which is also what happens when the gateway dies.
"""

import math
import os
import pickle
import resource
import struct
import sys
from typing import BinaryIO

READY = "ready"
PRIORITY_BELOW_GATEWAY = 10  # added to the process's nice value
_LENGTH = struct.Struct("!Q")


def write_frame(stream: BinaryIO, message: object) -> None:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_LENGTH.pack(len(payload)) + payload)
    stream.flush()


def read_frame(stream: BinaryIO) -> object | None:
    """The next message, or None at the end of the stream."""
    head = stream.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        return None
    (length,) = _LENGTH.unpack(head)
    payload = stream.read(length)
    return pickle.loads(payload) if len(payload) == length else None


def _limit_cpu(budget_s: int) -> None:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    used = usage.ru_utime + usage.ru_stime
    resource.setrlimit(resource.RLIMIT_CPU, (math.ceil(used) + budget_s, resource.RLIM_INFINITY))


def main() -> None:
    frames_out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    # A job killed for its budget must not leave a core file behind.
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    # Large bodies wait rather than slow the engine workers and the gateway on shared cores.
    os.nice(PRIORITY_BELOW_GATEWAY)
    # Imported after the descriptors are set up: loading the models may print.
    from controlplane.gateway.catalog import load_catalog
    from controlplane.gateway.errors import as_gateway_error
    from controlplane.gateway.prepare_jobs import PrepareJob, run_job

    catalog = load_catalog()
    write_frame(frames_out, READY)
    while (message := read_frame(sys.stdin.buffer)) is not None:
        job, budget_s = message
        assert isinstance(job, PrepareJob)
        _limit_cpu(budget_s)
        try:
            result = run_job(job, catalog)
        except Exception as error:
            refusal = as_gateway_error(error)
            reply = ("error", refusal.kind, refusal.message, refusal.param)
        else:
            # A prepared generation cannot travel (its response builder holds native objects): the
            # gateway prepares it again, knowing that it is valid and fits its context window, with
            # the images read here (so that none is fetched or decoded twice).
            reply = ("ok", result if isinstance(result, int) else result.read_images)
        write_frame(frames_out, reply)


if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    main()
