"""The three streaming APIs the benchmark speaks: where a request goes, its body and headers, and what
each stream event says (text, usage, the end, an error).

- `completions`: OpenAI /v1/completions with the prompt as token ids; text in `choices[0].text`.
- `chat`: OpenAI /v1/chat/completions, the prompt text as one user message; text (and reasoning)
  in `choices[0].delta`. Both ask for usage in a last chunk (`stream_options.include_usage`) and end
  with `data: [DONE]`.
- `messages`: Anthropic /v1/messages; the prompt's tokens (input + cache creation + cache read) in
  `message_start`, output tokens in `message_delta`, text in `content_block_delta`, ended by
  `message_stop`. Authenticates with `x-api-key` where the OpenAI APIs send a Bearer token.
"""

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from bench.serve.datasets.request import BenchRequest
from bench.serve.sse import SseEvent

ANTHROPIC_VERSION = "2023-06-01"


@dataclass(frozen=True)
class Usage:
    """What one event reports of the request's usage; None where it says nothing."""

    prompt_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None


@dataclass(frozen=True)
class StreamUpdate:
    text: str = ""
    usage: Usage | None = None
    done: bool = False
    error: str | None = None


@dataclass(frozen=True)
class GenerationSettings:
    model: str
    temperature: float
    ignore_eos: bool  # vLLM's extension, sent only when asked: other servers may refuse unknown fields


class StreamingApi(Protocol):
    name: str
    path: str  # under the server's root
    needs_text: bool  # whether requests carry the prompt as text (decoded from its ids)

    def headers(self, api_key: str | None) -> dict[str, str]: ...

    def body(self, request: BenchRequest, settings: GenerationSettings) -> dict: ...

    def read(self, event: SseEvent) -> StreamUpdate: ...


class OpenAICompletions:
    name = "completions"
    path = "/v1/completions"
    needs_text = False

    def headers(self, api_key: str | None) -> dict[str, str]:
        return {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def body(self, request: BenchRequest, settings: GenerationSettings) -> dict:
        return {"prompt": request.prompt_ids.tolist(), **_openai_fields(request, settings)}

    def read(self, event: SseEvent) -> StreamUpdate:
        return _read_openai(event, lambda choice: choice.get("text") or "")


class OpenAIChat(OpenAICompletions):
    name = "chat"
    path = "/v1/chat/completions"
    needs_text = True

    def body(self, request: BenchRequest, settings: GenerationSettings) -> dict:
        return {"messages": [{"role": "user", "content": request.text}], **_openai_fields(request, settings)}

    def read(self, event: SseEvent) -> StreamUpdate:
        return _read_openai(event, _chat_delta_text)


class AnthropicMessages:
    name = "messages"
    path = "/v1/messages"
    needs_text = True

    def headers(self, api_key: str | None) -> dict[str, str]:
        return {"anthropic-version": ANTHROPIC_VERSION, **({"x-api-key": api_key} if api_key else {})}

    def body(self, request: BenchRequest, settings: GenerationSettings) -> dict:
        body = {
            "model": settings.model,
            "messages": [{"role": "user", "content": request.text}],
            "max_tokens": request.output_len,
            "temperature": settings.temperature,
            "stream": True,
        }
        return {**body, "ignore_eos": True} if settings.ignore_eos else body

    def read(self, event: SseEvent) -> StreamUpdate:
        data = json.loads(event.data)
        kind = data.get("type")
        if kind == "content_block_delta":
            delta = data.get("delta") or {}
            return StreamUpdate(text=delta.get("text") or delta.get("thinking") or "")
        if kind == "message_start":
            return StreamUpdate(usage=_anthropic_usage((data.get("message") or {}).get("usage")))
        if kind == "message_delta":
            # Its usage may repeat the input counts without the cache breakdown: only the output is new.
            return StreamUpdate(usage=Usage(output_tokens=(data.get("usage") or {}).get("output_tokens")))
        if kind == "message_stop":
            return StreamUpdate(done=True)
        if kind == "error":
            return StreamUpdate(error=_error_message(data))
        return StreamUpdate()


API_PROTOCOLS: dict[str, StreamingApi] = {
    api.name: api for api in (OpenAICompletions(), OpenAIChat(), AnthropicMessages())
}


def _openai_fields(request: BenchRequest, settings: GenerationSettings) -> dict:
    fields = {
        "model": settings.model,
        "max_tokens": request.output_len,
        "temperature": settings.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return {**fields, "ignore_eos": True} if settings.ignore_eos else fields


def _read_openai(event: SseEvent, choice_text: Callable[[dict], str]) -> StreamUpdate:
    if event.data.strip() == "[DONE]":
        return StreamUpdate(done=True)
    data = json.loads(event.data)
    if "error" in data:
        return StreamUpdate(error=_error_message(data))
    choices = data.get("choices") or []
    text = "".join(choice_text(choice) for choice in choices)
    usage = data.get("usage")
    if not usage:
        return StreamUpdate(text=text)
    details = usage.get("prompt_tokens_details") or {}
    return StreamUpdate(
        text=text,
        usage=Usage(
            prompt_tokens=usage.get("prompt_tokens"),
            output_tokens=usage.get("completion_tokens"),
            cached_tokens=details.get("cached_tokens"),
        ),
    )


def _chat_delta_text(choice: dict) -> str:
    delta = choice.get("delta") or {}
    # Reasoning models stream their thinking first (vLLM: reasoning_content; newer: reasoning); it is output too.
    return (delta.get("content") or "") + (delta.get("reasoning_content") or delta.get("reasoning") or "")


def _anthropic_usage(usage: dict | None) -> Usage | None:
    if not usage:
        return None
    parts = [usage.get(name) for name in ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")]
    prompt_tokens = sum(part or 0 for part in parts) if parts[0] is not None else None
    return Usage(prompt_tokens=prompt_tokens, cached_tokens=usage.get("cache_read_input_tokens"))


def _error_message(data: dict) -> str:
    error = data.get("error")
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error or data)
