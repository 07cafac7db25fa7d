"""Request fields read here rather than by deepseek-recipe, which ignores them (n, penalties,
logit_bias, top_k, stream_options) or does not know the API (legacy Completions): each is checked
and a bad value raises an ApiError that names the field."""

import math
from collections.abc import Mapping

from recipe.errors import invalid_request

MAX_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0
# OpenAI's range for `seed`; the engine folds every seed to 64 bits, so negative ones are seeds too.
SEED_RANGE = (-(2**63), 2**63 - 1)


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
    # An int is finite however large (math.isfinite would overflow converting it).
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or (isinstance(value, float) and not math.isfinite(value))
    ):
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


def choices(body: Mapping, max_choices: int) -> int:
    return integer(body, "n", low=1, high=max_choices, default=1)


def seed(body: Mapping) -> int | None:
    return integer(body, "seed", low=SEED_RANGE[0], high=SEED_RANGE[1])


def top_k(body: Mapping, vocab_size: int) -> int:
    """0 disables top-k sampling; so does any k that keeps the whole vocabulary, which is what it
    becomes (the engine takes the ints it can hold)."""
    k = integer(body, "top_k", low=0, default=0)
    return 0 if k >= vocab_size else k


def max_tokens(body: Mapping, name: str, max_model_len: int, *, default: int | None = None) -> int | None:
    """A token count: more than the context window can never be served, so it is refused before any work."""
    return integer(body, name, low=1, high=max_model_len, default=default)


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
        token_id = _token_id(key, vocab_size)
        if token_id is None:
            raise invalid_request(f"`logit_bias` key {key!r} is not a token id in [0, {vocab_size})", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise invalid_request(f"`logit_bias` values must be numbers in [-100, 100], got {bias!r}", "logit_bias")
        biases[token_id] = float(bias)
    return biases or None


def _token_id(key: str, vocab_size: int) -> int | None:
    # isdigit() also holds for digits that int() does not read ("²"), and int() refuses keys of
    # thousands of digits: only short ASCII digit strings can be token ids.
    if not (key.isascii() and key.isdigit()) or len(key) > len(str(vocab_size)):
        return None
    token_id = int(key)
    return token_id if token_id < vocab_size else None


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
