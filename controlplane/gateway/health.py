"""Whether the workers this gateway sees can serve a request: what /healthz reports."""

from collections.abc import Sequence

from workers.protocol.messages import WorkerHeartbeat


def can_serve(workers: Sequence[WorkerHeartbeat]) -> bool:
    """A request needs a mixed worker, or a prefill and a decode worker; only ready ones take requests
    (a draining or drained worker is listed but does not count)."""
    ready_roles = {worker.role for worker in workers if worker.state == "ready"}
    return "mixed" in ready_roles or {"prefill", "decode"} <= ready_roles


def health_report(workers: Sequence[WorkerHeartbeat]) -> dict:
    return {
        "status": "ok" if can_serve(workers) else "unavailable",
        "workers": [
            {
                "worker_id": worker.worker_id,
                "model": worker.model,
                "role": worker.role,
                "state": worker.state,
                "num_running": worker.num_running,
                "num_waiting": worker.num_waiting,
                "kv_usage": worker.kv_usage,
            }
            for worker in workers
        ],
    }
