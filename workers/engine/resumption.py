"""What lets a request continue on another engine: a seed for every sampled request, the moment a
running request can be suspended for migration, the checks on a resumed request's tokens, and the
counters of resumed requests (how many, tokens recomputed, time to their first new token)."""

import random
import time
from dataclasses import dataclass

import msgspec

from workers.engine.request import PENDING_TOKEN, Request, RequestStatus
from workers.protocol.errors import InvalidRequestError
from workers.protocol.sampling_params import SamplingParams

SEED_BITS = 64


def with_seed(params: SamplingParams, seeds: random.Random) -> SamplingParams:
    """`params`, with a seed drawn from `seeds` when it samples without one. The sampler's draw for
    a seeded request depends on the seed and the token's position only, so the seed is the whole of
    its random state: a handoff or checkpoint that carries the params carries it."""
    if params.is_greedy or params.seed is not None:
        return params
    return msgspec.structs.replace(params, seed=seeds.getrandbits(SEED_BITS))


def check_suspendable(request: Request) -> bool:
    """Whether a request sits between two decode steps: every token but the last sampled one has
    its KV, and the last one's id is known, as a KVHandoff requires."""
    return (
        request.status is RequestStatus.RUNNING
        and not request.is_finished
        and bool(request.output_token_ids)
        and request.output_token_ids[-1] != PENDING_TOKEN
        and request.num_computed_tokens == request.num_tokens - 1
    )


def check_resumable(
    request_id: str, output_token_ids: list[int], params: SamplingParams, max_tokens: int, vocab_size: int
) -> None:
    """InvalidRequestError unless a resumed request's tokens are ids of this vocabulary, leave it
    something to generate, and its params carry a seed when it samples."""
    if any(not isinstance(token, int) or not 0 <= token < vocab_size for token in output_token_ids):
        raise InvalidRequestError(f"resumed request {request_id!r} needs its output tokens in [0, {vocab_size})")
    if len(output_token_ids) >= max_tokens:
        raise InvalidRequestError(
            f"resumed request {request_id!r} already has {len(output_token_ids)} of its {max_tokens} tokens"
        )
    if not params.is_greedy and params.seed is None:
        raise InvalidRequestError(f"resumed request {request_id!r} samples without a seed: it cannot continue")


@dataclass(slots=True)
class ResumeStats:
    num_resumed: int = 0
    num_recomputed_tokens: int = 0  # run through the model again: tokens the store did not hold
    max_recomputed_tokens: int = 0
    seconds_total: float = 0.0  # from each resume to its first new token

    def start(self, request: Request) -> None:
        request.resumed_at = time.monotonic()
        request.resumed_tokens = request.num_tokens

    def first_token(self, request: Request) -> None:
        """The resumed request sampled its first new token: its recompute is over."""
        recomputed = request.resumed_tokens - request.num_cached_tokens
        self.num_resumed += 1
        self.num_recomputed_tokens += recomputed
        self.max_recomputed_tokens = max(self.max_recomputed_tokens, recomputed)
        self.seconds_total += time.monotonic() - request.resumed_at
        request.resumed_at = 0.0
        request.num_cached_tokens = request.reported_cached_tokens
