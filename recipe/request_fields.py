"""Request fields read here rather than by deepseek-recipe, which ignores them (n, penalties,
logit_bias, top_k, stream_options) or does not know the API (legacy Completions): each is checked
and a bad value raises an ApiError that names the field."""

import math
from collections.abc import Mapping

from recipe.errors import invalid_request

MAX_CHOICES = 16
MAX_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0
MAX_SEED = 2**63 - 1


def integer(body: Mapping, name: str, *, low: int, high: int | None = None, default: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid_request(f"`{name}` must be an integer, got {value!r}", name)
    if value < low or (high is not None and value > high):
        bounds = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise invalid_request(f"`{name}` must be {bounds}, got {value}", name)
    return value


def number(body: Mapping, name: str, *, low: float, high: float, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise invalid_request(f"`{name}` must be a number, got {value!r}", name)
    if not low <= value <= high:
        raise invalid_request(f"`{name}` must be between {low:g} and {high:g}, got {value}", name)
    return float(value)


def boolean(body: Mapping, name: str, *, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid_request(f"`{name}` must be a boolean, got {value!r}", name)
    return value


def choices(body: Mapping) -> int:
    return integer(body, "n", low=1, high=MAX_CHOICES, default=1)


def penalty(body: Mapping, name: str) -> float:
    return number(body, name, low=-MAX_PENALTY, high=MAX_PENALTY, default=0.0)


def logit_bias(body: Mapping, vocab_size: int) -> dict[int, float] | None:
    """OpenAI's `{"token id": bias}`; JSON object keys are strings."""
    value = body.get("logit_bias")
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise invalid_request("`logit_bias` must be an object mapping token ids to biases", "logit_bias")
    biases = {}
    for key, bias in value.items():
        token_id = int(key) if isinstance(key, str) and key.isdigit() else None
        if token_id is None or token_id >= vocab_size:
            raise invalid_request(f"`logit_bias` key {key!r} is not a token id in [0, {vocab_size})", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise invalid_request(f"`logit_bias` values must be numbers in [-100, 100], got {bias!r}", "logit_bias")
        biases[token_id] = float(bias)
    return biases or None


def include_usage(body: Mapping, *, stream: bool) -> bool:
    """`stream_options.include_usage`; stream_options is only allowed on a streamed request."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise invalid_request("`stream_options` is only allowed when `stream` is true", "stream_options")
    if not isinstance(options, Mapping):
        raise invalid_request("`stream_options` must be an object", "stream_options")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise invalid_request("`stream_options.include_usage` must be a boolean", "stream_options.include_usage")
    return include


def greedy_when_top_p_is_zero(temperature: float, top_p: float) -> tuple[float, float]:
    """(temperature, top_p) to sample with: top_p 0 lets only the most likely token be chosen, which is
    greedy decoding."""
    return (0.0, 1.0) if top_p == 0 else (temperature, top_p)
