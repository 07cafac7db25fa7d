"""The legacy `/v1/completions` request, which deepseek-recipe does not cover: a raw prompt (a string,
or token ids) continued as it is, with no chat template.

A string prompt is encoded with `allow_special=False`: text never becomes a control token. Token ids
are taken as given (a client that sends ids chose them). Stop strings are the engine's to apply and
leave out of the text, as OpenAI does for this API.
"""

from collections.abc import Mapping

from recipe import request_fields
from recipe.cache_hints import read_cache_request
from recipe.completions_response import CompletionsResponse
from recipe.errors import invalid_request
from recipe.limits import RequestLimits
from recipe.prepared_request import PreparedRequest, ResponseBuilder
from recipe.served_model import ServedModel
from workers.protocol.errors import InvalidRequestError
from workers.protocol.messages import CacheHint
from workers.protocol.sampling_params import SamplingParams

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this API
MAX_LOGPROBS = 5
UNSUPPORTED_FIELDS = {"suffix": "`suffix` (insertion) is not supported"}


def prepare_completion(body: Mapping, model: ServedModel, limits: RequestLimits) -> PreparedRequest:
    for field, message in UNSUPPORTED_FIELDS.items():
        if body.get(field) is not None:
            raise invalid_request(message, field)
    best_of = request_fields.integer(body, "best_of", low=1, default=1)
    if best_of != 1:
        raise invalid_request("`best_of` is not supported; use `n`", "best_of")

    n = request_fields.choices(body, limits.max_choices)
    cache = read_cache_request("completions", body, limits)
    stream = request_fields.boolean(body, "stream", default=False)
    include_usage = request_fields.include_usage(body, stream=stream)
    echo = request_fields.boolean(body, "echo", default=False)
    logprobs = request_fields.integer(body, "logprobs", low=0, high=MAX_LOGPROBS)
    max_tokens = request_fields.max_tokens(body, "max_tokens", model.max_model_len, default=DEFAULT_MAX_TOKENS)
    params = _sampling_params(body, max_tokens, logprobs, model)
    # Last: encoding the prompt is the work the checks above spare a refused request.
    prompt_token_ids, echo_text = _prompt(body, model)
    _check_context_window(len(prompt_token_ids), max_tokens, model.max_model_len)

    def new_response(response_id: str, created: int) -> ResponseBuilder:
        return CompletionsResponse(
            response_id=response_id,
            created=created,
            model=model.name,
            n=n,
            tokenizer=model.tokenizer,
            prompt_token_ids=prompt_token_ids,
            echo_text=echo_text if echo else None,
            logprobs=logprobs is not None,
            include_usage=include_usage,
        )

    return PreparedRequest(
        protocol="completions",
        model=model.name,
        stream=stream,
        n=n,
        prompt_token_ids=prompt_token_ids,
        constraint=None,
        prompt_logprobs=logprobs if echo and logprobs is not None else None,
        traffic_class="chat",
        params=params,
        response_factory=new_response,
        # OpenAI's hints here are about the whole prompt ("24h" retention).
        cache_hints=tuple(CacheHint(len(prompt_token_ids), breakpoint.retain_s) for breakpoint in cache.breakpoints),
        prompt_cache_key=cache.prompt_cache_key,
    )


def _prompt(body: Mapping, model: ServedModel) -> tuple[list[int], str]:
    """The prompt's token ids and its text (what `echo` repeats)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        token_ids = model.tokenizer.encode(prompt, allow_special=False)
        text = prompt
    elif isinstance(prompt, list) and all(isinstance(token, int) and not isinstance(token, bool) for token in prompt):
        vocab_size = model.tokenizer.vocab_size
        if any(not 0 <= token < vocab_size for token in prompt):
            raise invalid_request(f"prompt token ids must be in [0, {vocab_size})", "prompt")
        token_ids = list(prompt)
        text = model.tokenizer.decode(token_ids, skip_special_tokens=False)
    else:
        raise invalid_request("`prompt` must be a string or a list of token ids (one prompt per request)", "prompt")
    if not token_ids:
        raise invalid_request("`prompt` is empty", "prompt")
    return token_ids, text


def _check_context_window(prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    if prompt_tokens + max_tokens > max_model_len:
        raise invalid_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in your prompt; {max_tokens} for the "
            "completion). Please reduce your prompt or completion length.",
            "max_tokens" if prompt_tokens < max_model_len else "prompt",
        )


def _sampling_params(body: Mapping, max_tokens: int, logprobs: int | None, model: ServedModel) -> SamplingParams:
    temperature = request_fields.number(body, "temperature", low=0.0, high=2.0, default=1.0)
    top_p = request_fields.number(body, "top_p", low=0.0, high=1.0, default=1.0)
    temperature, top_p = request_fields.greedy_when_top_p_is_zero(temperature, top_p)
    try:
        return SamplingParams(
            temperature=temperature,
            top_p=top_p,
            top_k=request_fields.top_k(body, model.tokenizer.vocab_size),
            seed=request_fields.seed(body),
            presence_penalty=request_fields.penalty(body, "presence_penalty"),
            frequency_penalty=request_fields.penalty(body, "frequency_penalty"),
            logit_bias=request_fields.logit_bias(body, model.tokenizer.vocab_size),
            ignore_eos=request_fields.boolean(body, "ignore_eos", default=False),
            max_tokens=max_tokens,
            stop=_stop_strings(body),
            logprobs=logprobs,
        )
    except InvalidRequestError as error:
        raise invalid_request(str(error)) from None


def _stop_strings(body: Mapping) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(item, str) and item for item in stops):
        raise invalid_request("`stop` must be a non-empty string or a list of them", "stop")
    return tuple(stops)
