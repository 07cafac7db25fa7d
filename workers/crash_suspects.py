"""Requests that were in flight on an engine worker when it failed, remembered so that a request
which may have crashed one worker is not sent on to crash the next (and then the restarted ones).

When a worker fails as a whole nobody can tell which of its requests caused it, so each of them is
a suspect. A suspect is retried once, on other workers (most were innocent bystanders); after a
second failure it is not retried again, and neither is the same request sent again later (same
prompt, sampling parameters and constraint: a client repeating it), which fails at its first crash.
"""

import hashlib
from collections import OrderedDict

import msgspec

from workers.protocol import GenerateRequest

MAX_SUSPECTS = 4096  # the oldest are forgotten first


def fingerprint(request: GenerateRequest) -> bytes:
    """What makes two requests the same work for an engine, whatever their ids."""
    key = (request.prompt_token_ids, request.params, request.constraint, request.prompt_logprobs)
    return hashlib.blake2b(msgspec.msgpack.encode(key), digest_size=16).digest()


class CrashSuspects:
    def __init__(self, max_suspects: int = MAX_SUSPECTS) -> None:
        self.max_suspects = max_suspects
        self._seen: OrderedDict[bytes, None] = OrderedDict()

    def record(self, request: GenerateRequest) -> bool:
        """Remember the request as in flight on a worker that failed; True when it already was."""
        key = fingerprint(request)
        known = key in self._seen
        self._seen[key] = None
        self._seen.move_to_end(key)
        while len(self._seen) > self.max_suspects:
            self._seen.popitem(last=False)
        return known
