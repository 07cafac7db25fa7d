"""The logprobs of one token, as the sampler computes them and every output message carries them.

Torch-free, so that the protocol and the gateway can import it without the engine.
"""

import msgspec


class TokenLogprobs(msgspec.Struct, frozen=True, array_like=True):
    token_id: int
    logprob: float
    rank: int  # 1 + how many tokens are strictly more likely; 1 = most likely
    top: list[tuple[int, float]]  # the top-k (token id, logprob), most likely first, ties by lower id; [] when k = 0
