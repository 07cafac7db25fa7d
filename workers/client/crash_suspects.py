"""Requests that were in flight on an engine worker when it failed, remembered so that a request
which may have crashed one worker is not sent on to crash the next (and then the restarted ones).

When a worker fails as a whole nobody can tell which of its requests caused it, so each of them is
a suspect. A suspect is retried once, on other workers (most were innocent bystanders); after a
second failure it is not retried again, and neither is the same request sent again later (same
prompt, sampling parameters and constraint: a client repeating it), which fails at its first crash.
"Again" means after the failure: the same request sent before it, in flight beside the suspect (a
response's choices of one prompt), gets a retry of its own.

Where a suspect may run: never on the last worker able to serve requests (a ready one), so that
whatever it brings down, the stack keeps answering. Run whole on one worker, or resumed on or moved
to one decode worker, it needs another ready worker besides (`leaves_another`). Split over a prefill
and a decode worker it always leaves one, since one request cannot bring down both: the decode
worker computes nothing of it before the prefill worker is done with it. With nowhere left to run
it, a suspect fails alone with "worker_failed".
"""

import hashlib
from collections import OrderedDict
from collections.abc import Collection

import msgspec

from workers.protocol.messages import GenerateRequest

MAX_SUSPECTS = 4096  # the oldest are forgotten first


def fingerprint(request: GenerateRequest) -> bytes:
    """What makes two requests the same work for an engine, whatever their ids."""
    key = (request.prompt_token_ids, request.params, request.constraint, request.prompt_logprobs)
    return hashlib.blake2b(msgspec.msgpack.encode(key), digest_size=16).digest()


def leaves_another(ready: Collection[object], worker: object) -> bool:
    """Whether running a suspect on `worker` alone leaves a worker of `ready` (the workers able to
    serve requests now) that it does not run on."""
    return any(other is not worker for other in ready)


class CrashSuspects:
    def __init__(self, max_suspects: int = MAX_SUSPECTS) -> None:
        self.max_suspects = max_suspects
        self._seen: OrderedDict[bytes, None] = OrderedDict()

    def record(self, request: GenerateRequest) -> None:
        """Remember the request as in flight on a worker that failed."""
        key = fingerprint(request)
        self._seen[key] = None
        self._seen.move_to_end(key)
        while len(self._seen) > self.max_suspects:
            self._seen.popitem(last=False)

    def suspected(self, request: GenerateRequest) -> bool:
        """Whether the same request was in flight on a worker that failed."""
        return fingerprint(request) in self._seen
