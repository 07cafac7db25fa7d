"""How one request wants its tokens chosen, validated when it is built or decoded.

A msgspec Struct so that it can ride inside ZMQ messages unchanged. msgspec wraps a ValueError or
TypeError raised in ``__post_init__`` during decoding: the decoder raises ``msgspec.ValidationError``
whose message is ours (plus `` - at `$.path` `` when the struct is nested) and whose ``__cause__`` is
the InvalidRequestError itself; any other exception would escape unwrapped. ``invalid_request_from``
turns every decode failure (our bad value, or a malformed payload, wrong type or unknown field that
msgspec rejects on its own) into an InvalidRequestError; ``decode_sampling_params`` applies it to a
bare payload, and a decoder of an enclosing message can apply it the same way.
"""

import math
from typing import Literal

import msgspec

from workers.protocol.errors import InvalidRequestError

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0
MAX_OPENAI_PENALTY = 2.0

_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # (0, 1]; 1 = disabled
    top_k: int = 0  # 0 or -1 = disabled, else >= 1
    min_p: float = 0.0  # [0, 1]; 0 = disabled
    seed: int | None = None  # same seed + same prompt = same tokens, whatever else is batched
    repetition_penalty: float = 1.0  # > 0; HF semantics, over prompt and output tokens
    frequency_penalty: float = 0.0  # [-2, 2]; OpenAI semantics, output tokens only
    presence_penalty: float = 0.0  # [-2, 2]; OpenAI semantics, output tokens only
    max_tokens: int | None = None  # None = up to the context window (the engine checks the window)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # None = none; k = the sampled token's logprob plus the top k
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit

    def __post_init__(self) -> None:
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            _require(math.isfinite(value), f"{name} must be a finite number, got {value}")
        _require(self.n >= 1, f"n must be >= 1, got {self.n}")
        _require(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        _require(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        _require(self.top_k >= -1, f"top_k must be -1, 0 (disabled) or >= 1, got {self.top_k}")
        _require(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        _require(self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            _require(abs(value) <= MAX_OPENAI_PENALTY, f"{name} must be in [-2, 2], got {value}")
        if self.max_tokens is not None:
            _require(self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}")
        _require(all(self.stop), f"stop must not contain empty strings, got {self.stop!r}")
        for token_id in self.stop_token_ids:
            _require(token_id >= 0, f"stop_token_ids must be >= 0, got {token_id}")
        if self.logprobs is not None:
            _require(
                0 <= self.logprobs <= MAX_LOGPROBS, f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}"
            )
        for token_id, bias in (self.logit_bias or {}).items():
            _require(token_id >= 0, f"logit_bias token ids must be >= 0, got {token_id}")
            _require(
                -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS,
                f"logit_bias values must be in [-100, 100], got {bias} for token {token_id}",
            )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


def invalid_request_from(error: msgspec.DecodeError) -> InvalidRequestError:
    """The InvalidRequestError behind a failed decode: our own when ``__post_init__`` raised it,
    else one carrying msgspec's message (malformed payload, wrong type, unknown field)."""
    if isinstance(error.__cause__, InvalidRequestError):
        return error.__cause__
    return InvalidRequestError(str(error))


def decode_sampling_params(payload: bytes, *, encoding: Literal["json", "msgpack"]) -> SamplingParams:
    decoder = msgspec.json.decode if encoding == "json" else msgspec.msgpack.decode
    try:
        return decoder(payload, type=SamplingParams)
    except msgspec.DecodeError as error:
        raise invalid_request_from(error) from None


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise InvalidRequestError(message)
