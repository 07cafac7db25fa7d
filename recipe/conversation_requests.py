"""Chat Completions, Responses and Messages requests → a PreparedRequest, through deepseek-recipe.

The library converts the request into a Conversation plus inference and parsing options; this module
adds what it leaves to the caller: prompt encoding per model family, the context-window check, the
fields it ignores (n, penalties, logit_bias, top_k, stream_options, max_completion_tokens) and the
sampling parameters. Its errors become ApiErrors naming the field: the one its message names, or
else the top-level field it could not read.

Stop strings go to the engine with `include_stop_str_in_output`: the engine stops on them, and the
processor, seeing the stop string in the text, cuts it and reports it (Anthropic's `stop_sequence`).
"""

import itertools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import deepseek_recipe

from recipe import request_fields
from recipe.cache_breakpoints import PlacedHints, place_breakpoints
from recipe.cache_hints import CacheRequest, read_cache_request
from recipe.chatml import PromptText
from recipe.conversation_responses import ConversationResponseFactory, choice_feed
from recipe.errors import ApiError, invalid_request
from recipe.image_prompts import encode_images, expand_images, refuse_marker_text
from recipe.images.parts import image_parts
from recipe.images.resolve import RequestImage, resolve_images
from recipe.limits import RequestLimits
from recipe.prepared_request import PreparedRequest
from recipe.prompt_encoding import encode_conversation, encode_prompt_text, render_prompt
from recipe.served_model import ServedModel
from workers.protocol.errors import InvalidRequestError
from workers.protocol.messages import OutputConstraintSpec
from workers.protocol.sampling_params import MAX_LOGPROBS, SamplingParams

ConversationProtocol = Literal["chat.completions", "responses", "messages"]
LibraryRequest = (
    deepseek_recipe.ChatCompletionRequest | deepseek_recipe.ResponsesRequest | deepseek_recipe.MessagesRequest
)

REQUEST_TYPES = {
    "chat.completions": deepseek_recipe.ChatCompletionRequest,
    "responses": deepseek_recipe.ResponsesRequest,
    "messages": deepseek_recipe.MessagesRequest,
}
MAX_TOKENS_FIELDS = {"chat.completions": "max_tokens", "responses": "max_output_tokens", "messages": "max_tokens"}
MESSAGES_FIELDS = {"chat.completions": "messages", "responses": "input", "messages": "messages"}
OUTPUT_FORMAT_FIELDS = {"chat.completions": "response_format", "responses": "text.format"}
TOOL_CALL_KINDS = ("tool_call", "tool_call_required")
# vLLM's `ignore_eos` extension; on Messages too, so that a benchmark gets the output lengths it asks for on each API.
IGNORE_EOS_PROTOCOLS = frozenset({"chat.completions", "messages"})
# Kept from the library: it rejects n > 1 (choices are fanned out here) and seeds outside [0, 2**63),
# which OpenAI accepts (the engine folds them).
FIELDS_READ_HERE = frozenset({"n", "seed"})
# The smallest body of each protocol that the library deserializes.
SKELETONS = {
    "chat.completions": {"messages": []},
    "responses": {"input": ""},
    "messages": {"messages": [], "max_tokens": 1},
}
# How many top-level fields are tried alone to find the one the library could not read: each try
# costs a parse of that field, so together they cost one more parse of the body.
MAX_FIELDS_TRIED = 64


def prepare_conversation_request(
    protocol: ConversationProtocol,
    body: Mapping,
    model: ServedModel,
    limits: RequestLimits,
    images: tuple[RequestImage, ...] | None = None,
) -> PreparedRequest:
    """`images`: the body's images as read already (by a prepare process); None: read here."""
    # Fields read here are checked before the library sees the body, so that errors name them.
    n = request_fields.choices(body, limits.max_choices) if protocol == "chat.completions" else 1
    cache = read_cache_request(protocol, body, limits)
    stream = request_fields.boolean(body, "stream", default=False)
    include_usage = request_fields.include_usage(body, stream=stream) if protocol == "chat.completions" else False
    _check_token_counts(protocol, body, model)
    sampling_fields = _sampling_fields(protocol, body, model)
    library_request = _library_request(protocol, body)
    responses_echo, namespace_tools = _responses_settings(library_request)
    image_parts(protocol, body)  # its refusals name the field; the library's name only the message
    converted = _converted(protocol, library_request, model.name)
    images = _request_images(protocol, body, model, limits, images)
    conversation = _with_anthropic_any_as_required(protocol, body, converted.conversation)
    forces_tool_call = conversation.tool_choice == "required" and bool(conversation.tools)
    prompt_token_ids = _encoded(conversation, model, protocol, images)
    try:
        max_tokens = converted.resolve_max_tokens(len(prompt_token_ids), model.max_model_len)
    except deepseek_recipe.ConversionError as error:
        raise invalid_request(str(error), MAX_TOKENS_FIELDS[protocol]) from None
    placed = _placed_hints(protocol, body, cache, conversation, prompt_token_ids, model, images)

    responses = ConversationResponseFactory(
        protocol=protocol,
        converted=converted,
        model_name=model.name,
        feed=choice_feed(converted, conversation, model, forces_tool_call=forces_tool_call),
        n=n,
        include_usage=include_usage,
        responses_echo=responses_echo,
        namespace_tools=namespace_tools,
        cache=cache,
        cache_ttls=placed.ttls,
    )
    return PreparedRequest(
        protocol=protocol,
        model=model.name,
        stream=stream,
        n=n,
        prompt_token_ids=prompt_token_ids,
        constraint=_constraint(converted.inference_options.output_constraint, model, forces_tool_call),
        prompt_logprobs=None,
        traffic_class="agent" if conversation.tools else "chat",
        params=_sampling_params(sampling_fields, converted, max_tokens),
        response_factory=responses.new_response,
        cache_hints=placed.hints,
        prompt_cache_key=cache.prompt_cache_key,
        images=encode_images(images, model.vision) if model.vision is not None else (),
        read_images=images,
    )


def count_prompt_tokens(
    protocol: ConversationProtocol, body: Mapping, model: ServedModel, limits: RequestLimits
) -> int:
    """The prompt length this request would have (Anthropic's count_tokens, which takes no max_tokens);
    its cache hints are checked, and count for nothing."""
    read_cache_request(protocol, body, limits)
    library_request = _library_request(protocol, body)
    image_parts(protocol, body)  # its refusals name the field; the library's name only the message
    converted = _converted(protocol, library_request, model.name)
    images = _request_images(protocol, body, model, limits, None)
    conversation = _with_anthropic_any_as_required(protocol, body, converted.conversation)
    return len(_encoded(conversation, model, protocol, images))


def _request_images(
    protocol: ConversationProtocol,
    body: Mapping,
    model: ServedModel,
    limits: RequestLimits,
    read: tuple[RequestImage, ...] | None,
) -> tuple[RequestImage, ...]:
    """Every image read, fetched and decoded within `limits` (each refusal names its field), unless
    `read` already; a model that takes no images refuses the first one by name. A vision-language
    model first refuses text that spells its image marker (recipe.image_prompts)."""
    if model.vision is not None:
        refuse_marker_text(body)
    images = read if read is not None else resolve_images(protocol, body, limits)
    if images and model.vision is None:
        field = images[0].field
        raise invalid_request(f"`{field}`: model `{model.name}` does not accept images", field)
    return images


def _placed_hints(
    protocol: ConversationProtocol,
    body: Mapping,
    cache: CacheRequest,
    conversation: deepseek_recipe.Conversation,
    prompt_token_ids: list[int],
    model: ServedModel,
    images: tuple[RequestImage, ...],
) -> PlacedHints:
    if not cache.breakpoints:
        return PlacedHints()
    return place_breakpoints(
        cache.breakpoints,
        body=body,
        prompt=_prompt(conversation, model, protocol, images),
        conversation=conversation,
        token_ids=prompt_token_ids,
        tokenizer=model.tokenizer,
        render=lambda marked: _rendered(protocol, marked, model, images),
    )


def _rendered(
    protocol: ConversationProtocol, body: Mapping, model: ServedModel, images: tuple[RequestImage, ...]
) -> PromptText:
    """The prompt text `body` renders to (a request marked for its cache breakpoints)."""
    converted = _converted(protocol, _library_request(protocol, body), model.name)
    return _prompt(_with_anthropic_any_as_required(protocol, body, converted.conversation), model, protocol, images)


def _prompt(
    conversation: deepseek_recipe.Conversation,
    model: ServedModel,
    protocol: ConversationProtocol,
    images: tuple[RequestImage, ...],
) -> PromptText:
    """The rendered prompt, with each image's placeholders in place for a vision-language model."""
    prompt = render_prompt(conversation, model)
    if model.vision is None:
        return prompt
    return expand_images(prompt, images, model.vision, MESSAGES_FIELDS[protocol])


def _check_token_counts(protocol: ConversationProtocol, body: Mapping, model: ServedModel) -> None:
    """The library reads these, but would name no field, or the wrong one, for a bad value."""
    if protocol == "messages" and body.get("max_tokens") is None:
        raise invalid_request("`max_tokens` is required", "max_tokens")
    request_fields.max_tokens(body, MAX_TOKENS_FIELDS[protocol], model.max_model_len)
    if protocol == "chat.completions":
        request_fields.max_tokens(body, "max_completion_tokens", model.max_model_len)
    if protocol != "messages":
        request_fields.integer(body, "top_logprobs", low=0, high=MAX_LOGPROBS)


def conversion_options(model_name: str) -> deepseek_recipe.ConversionOptions:
    # Every served model is converted as V4.1 Flash: the versions differ only in prompt encoding,
    # which recipe.prompt_encoding chooses per model family.
    options = deepseek_recipe.ConversionOptions(default_thinking_mode=False)
    return options.with_model_alias(model_name, deepseek_recipe.ModelVersion.DeepseekV41Flash)


def _library_request(protocol: ConversationProtocol, body: Mapping) -> LibraryRequest:
    """The request as the library should see it: without the fields read here, and with
    `max_completion_tokens`, which it ignores, as `max_tokens`."""
    field = MESSAGES_FIELDS[protocol]
    allowed_types = (str, list) if protocol == "responses" else (list,)
    if not isinstance(body.get(field), allowed_types):
        shapes = "a string or a list" if protocol == "responses" else "a list"
        raise invalid_request(f"`{field}` is required and must be {shapes}", field)
    library_body = {key: value for key, value in body.items() if key not in FIELDS_READ_HERE}
    if protocol == "chat.completions" and body.get("max_completion_tokens") is not None:
        library_body["max_tokens"] = library_body.pop("max_completion_tokens")
    try:
        return REQUEST_TYPES[protocol](library_body)
    except ValueError as error:  # a body the library cannot deserialize: missing field, wrong type
        message = str(error)
        raise _library_refusal(
            400, message, _named_param(message, protocol) or _undeserializable_field(protocol, library_body)
        ) from None


def _undeserializable_field(protocol: ConversationProtocol, library_body: Mapping) -> str | None:
    """The first top-level field that the library cannot deserialize even in a skeleton body."""
    skeleton = {"model": library_body.get("model"), **SKELETONS[protocol]}
    for name in itertools.islice(library_body, MAX_FIELDS_TRIED):
        try:
            REQUEST_TYPES[protocol]({**skeleton, name: library_body[name]})
        except ValueError:
            return name
    return None


def _responses_settings(
    request: LibraryRequest,
) -> tuple[deepseek_recipe.ResponsesEcho | None, dict[str, tuple[str, str]]]:
    """What a Responses response reports about its request; read before conversion consumes it."""
    if not isinstance(request, deepseek_recipe.ResponsesRequest):
        return None, {}
    try:
        return request.echo(), request.namespace_tool_map(conversion_options(request.model))
    except deepseek_recipe.ConversionError as error:
        raise _api_error(error, "responses") from None


def _converted(
    protocol: ConversationProtocol, request: LibraryRequest, model_name: str
) -> deepseek_recipe.ConversationRequest:
    try:
        return request.convert(conversion_options(model_name))
    except deepseek_recipe.ConversionError as error:
        raise _api_error(error, protocol) from None


def _with_anthropic_any_as_required(
    protocol: ConversationProtocol, body: Mapping, conversation: deepseek_recipe.Conversation
) -> deepseek_recipe.Conversation:
    """Anthropic's tool_choice {"type": "any"} means "use one of the tools"; deepseek-recipe 0.2.0
    converts it to auto, so the conversation is rebuilt with the choice required."""
    tool_choice = body.get("tool_choice")
    is_any = protocol == "messages" and isinstance(tool_choice, Mapping) and tool_choice.get("type") == "any"
    if not is_any or not conversation.tools or conversation.tool_choice != "auto":
        return conversation
    return deepseek_recipe.Conversation(
        conversation.messages,
        thinking_mode=conversation.thinking_mode,
        tools=conversation.tools,
        tool_choice="required",
        reasoning_effort=conversation.reasoning_effort,
        response_format="json_object" if conversation.response_format == "json_object" else "text",
        response_schema=conversation.response_schema,
        response_regex=conversation.response_regex,
    )


def _encoded(
    conversation: deepseek_recipe.Conversation,
    model: ServedModel,
    protocol: ConversationProtocol,
    images: tuple[RequestImage, ...],
) -> list[int]:
    if model.vision is not None:
        return encode_prompt_text(_prompt(conversation, model, protocol, images), model.tokenizer)
    if any(message.image_sources for message in conversation.messages):
        raise invalid_request(f"model `{model.name}` does not accept images", MESSAGES_FIELDS[protocol])
    return encode_conversation(conversation, model)


def _api_error(error: deepseek_recipe.ConversionError, protocol: ConversationProtocol) -> ApiError:
    status = error.status_code if 400 <= error.status_code < 500 else 400
    return _library_refusal(status, str(error), _named_param(str(error), protocol))


def _library_refusal(status: int, message: str, param: str | None) -> ApiError:
    """The library's message, led by the field it is about where it does not name it (Anthropic's
    errors have no `param`: the message is where a client reads the field)."""
    if param is not None and f"`{param}`" not in message:
        message = f"`{param}`: {message.removeprefix(f'{param}: ')}"
    return ApiError(status, "invalid_request_error", message, param)


_PARAM_PATTERNS = (
    re.compile(r"Invalid (\w+) value"),
    re.compile(r"Invalid (\w+) and \w+ value"),  # "Invalid top_logprobs and logprobs value, ..."
    re.compile(r"missing field `(\w+)`"),
    re.compile(r"unknown field `(\w+)`"),
    re.compile(r"[Ii]nvalid value for '(\w+)'"),
    re.compile(r"^(\w+): "),  # "messages: at least one message is required"
    re.compile(r"`(\w+)\.\d"),  # "unexpected `messages.0.content.0: tool_use_id` found ..."
    re.compile(r"^(\w+)\.\d"),  # "messages.0.content: thinking blocks may only be in `assistant` messages"
)
# The library's messages that name no field, and the field each is about (found by bench.fuzz_api).
_MESSAGE_PARAMS = (
    ("Tool names must be unique", "tools"),
    ("Invalid schema for function", "tools"),
    ("Empty input messages", "messages"),
    ("Messages with role 'tool'", "messages"),
    ("Invalid assistant message", "messages"),
    ("An assistant message with 'tool_calls' must be followed", "messages"),
    ("Prompt must contain the word 'json'", "messages"),
    ("Input items array must not be empty", "input"),
    ("No tool call found for tool output", "input"),
    ("No tool output found for tool call", "input"),
    ("Duplicate 'call_id'", "input"),
    ("Response input messages must contain the word 'json'", "input"),
)


# Names the library's messages use for a request field of another name.
_PARAM_ALIASES = {"tool_call": "tool_choice"}


def _named_param(message: str, protocol: ConversationProtocol) -> str | None:
    """The request field a library error message is about, when it says or is known."""
    for pattern in _PARAM_PATTERNS:
        match = pattern.search(message)
        if match:
            return _PARAM_ALIASES.get(match.group(1), match.group(1))
    if "Invalid json schema" in message:  # the output format's, which each protocol names its own way
        return OUTPUT_FORMAT_FIELDS.get(protocol)
    return next((param for fragment, param in _MESSAGE_PARAMS if fragment in message), None)


def _constraint(
    constraint: deepseek_recipe.OutputConstraint | None, model: ServedModel, forces_tool_call: bool
) -> OutputConstraintSpec | None:
    if constraint is None:
        return None
    # The tool-call grammars describe ChatML's native call format; DeepSeek's DSML has none yet.
    if model.family == "deepseek_v41" and constraint.kind in TOOL_CALL_KINDS:
        return None
    kind = "tool_call_required" if forces_tool_call and constraint.kind == "tool_call" else constraint.kind
    return OutputConstraintSpec(kind=kind, schema=constraint.schema)


@dataclass(frozen=True)
class _SamplingFields:
    """What the request asks of sampling beyond what the library reports."""

    temperature: float | None  # None: the library's value (DeepSeek models)
    top_p: float | None
    top_k: int  # Anthropic's field; vLLM's extension on the OpenAI endpoints
    seed: int | None
    presence_penalty: float
    frequency_penalty: float
    logit_bias: dict[int, float] | None
    ignore_eos: bool  # vLLM's extension: generate through end-of-sequence tokens (benchmarks)


def _sampling_fields(protocol: ConversationProtocol, body: Mapping, model: ServedModel) -> _SamplingFields:
    is_chat = protocol == "chat.completions"
    # The library resolves temperature and top_p for DeepSeek models (V4.1 Flash: top_p fixed at 1,
    # values rounded to 32 bits); other models sample with what the request asked.
    own_values = model.family != "deepseek_v41"
    return _SamplingFields(
        temperature=request_fields.number(body, "temperature", low=0.0, high=2.0, default=1.0) if own_values else None,
        top_p=request_fields.number(body, "top_p", low=0.0, high=1.0, default=1.0) if own_values else None,
        top_k=request_fields.top_k(body, model.tokenizer.vocab_size),
        seed=request_fields.seed(body) if is_chat else None,
        presence_penalty=request_fields.penalty(body, "presence_penalty") if is_chat else 0.0,
        frequency_penalty=request_fields.penalty(body, "frequency_penalty") if is_chat else 0.0,
        logit_bias=request_fields.logit_bias(body, model.tokenizer.vocab_size) if is_chat else None,
        ignore_eos=protocol in IGNORE_EOS_PROTOCOLS and request_fields.boolean(body, "ignore_eos", default=False),
    )


def _sampling_params(
    fields: _SamplingFields, converted: deepseek_recipe.ConversationRequest, max_tokens: int
) -> SamplingParams:
    options = converted.inference_options
    temperature = fields.temperature if fields.temperature is not None else (options.temperature or 1.0)
    top_p = fields.top_p if fields.top_p is not None else (options.top_p or 1.0)
    temperature, top_p = request_fields.greedy_when_top_p_is_zero(temperature, top_p)
    try:
        return SamplingParams(
            temperature=temperature,
            top_p=top_p,
            top_k=fields.top_k,
            seed=fields.seed,
            presence_penalty=fields.presence_penalty,
            frequency_penalty=fields.frequency_penalty,
            logit_bias=fields.logit_bias,
            ignore_eos=fields.ignore_eos,
            max_tokens=max_tokens,
            stop=tuple(converted.parsing_options.stop_sequences),
            include_stop_str_in_output=True,
            logprobs=(options.top_logprobs or 0) if options.logprobs else None,
        )
    except InvalidRequestError as error:
        raise invalid_request(str(error)) from None
