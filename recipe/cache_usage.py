"""The prompt cache in each API's usage, as those APIs report it, from the engine's first output of a
choice (its prompt counts are final by then: workers.protocol.messages.GenerateOutput).

deepseek-recipe renders usage from the prompt and cache-hit counts alone; these reports add what the
store did with the prompt:
- Anthropic Messages: `cache_creation_input_tokens` (prompt tokens written to the store under a
  cache_control breakpoint), `cache_creation: {ephemeral_5m_input_tokens, ephemeral_1h_input_tokens}`
  by the breakpoint's ttl, and `input_tokens` the rest, so that input, creation and read tokens add
  up to the prompt, as Anthropic's do. In the body and `message_start` (with the breakdown) and in
  `message_delta` (whose usage has no breakdown).
- OpenAI Responses: `input_tokens_details.cache_write_tokens` (every prompt token written to the
  store) and, for a request with explicit breakpoints, `cache_write_tokens_details: {ttl_30m_tokens,
  ttl_12h_tokens}` (those written under them, by ttl); the response echoes `prompt_cache_key`,
  `prompt_cache_retention` and `prompt_cache_options`, in the body and each event that carries it.
- OpenAI Chat Completions and Completions: `prompt_tokens_details.cache_write_tokens`
  (recipe.codec_response, recipe.completions_response call `chat_usage`).
"""

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from recipe.prepared_request import SseEvent
from workers.protocol.messages import GenerateOutput

# The lifetimes of OpenAI's explicit breakpoints, which Responses usage breaks its cache writes down by.
BREAKPOINT_TTLS = ("30m", "12h")


@dataclass(frozen=True, slots=True)
class PromptCacheUsage:
    prompt_tokens: int
    read_tokens: int  # served from a cache
    written_tokens: int  # written to the store
    written_by_ttl: Mapping[str, int] = field(default_factory=dict)  # of those, under hints, by their ttl

    @classmethod
    def of(cls, output: GenerateOutput, ttls: Sequence[str]) -> "PromptCacheUsage":
        """`ttls`: the API's name of each of the request's hints' lifetimes, in the hints' order."""
        by_ttl: dict[str, int] = {}
        for ttl, tokens in zip(ttls, output.stored_tokens_by_hint):
            by_ttl[ttl] = by_ttl.get(ttl, 0) + tokens
        return cls(output.num_prompt_tokens, output.num_cached_tokens, output.num_stored_tokens, by_ttl)


class UsageReport(Protocol):
    """Adds the cache to one protocol's response body and the stream events named in `events`."""

    events: frozenset[str]

    def event(self, data: dict, cache: PromptCacheUsage) -> None: ...

    def body(self, body: dict, cache: PromptCacheUsage) -> None: ...


def reported(event: SseEvent, report: UsageReport | None, cache: PromptCacheUsage) -> SseEvent:
    """The event with the report's additions (only the few events that carry usage are parsed)."""
    if report is None or event.event not in report.events:
        return event
    data = json.loads(event.data)
    report.event(data, cache)
    return SseEvent(event.event, json.dumps(data, ensure_ascii=False, separators=(",", ":")))


@dataclass(frozen=True)
class MessagesUsageReport:
    events: frozenset[str] = frozenset({"message_start", "message_delta"})

    def event(self, data: dict, cache: PromptCacheUsage) -> None:
        if data.get("type") == "message_start":
            self.body(data["message"], cache)
        elif isinstance(data.get("usage"), dict):
            _anthropic_usage(data["usage"], cache, breakdown=False)

    def body(self, body: dict, cache: PromptCacheUsage) -> None:
        if isinstance(body.get("usage"), dict):
            _anthropic_usage(body["usage"], cache, breakdown=True)


@dataclass(frozen=True)
class ResponsesUsageReport:
    prompt_cache_key: str | None
    prompt_cache_retention: str | None
    prompt_cache_options: Mapping | None
    events: frozenset[str] = frozenset(
        {"response.created", "response.in_progress", "response.completed", "response.incomplete", "response.failed"}
    )

    def event(self, data: dict, cache: PromptCacheUsage) -> None:
        if isinstance(data.get("response"), dict):
            self.body(data["response"], cache)

    def body(self, body: dict, cache: PromptCacheUsage) -> None:
        body["prompt_cache_key"] = self.prompt_cache_key
        body["prompt_cache_retention"] = self.prompt_cache_retention
        body["prompt_cache_options"] = self.prompt_cache_options
        usage = body.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("input_tokens_details"), dict):
            details = usage["input_tokens_details"]
            details["cache_write_tokens"] = cache.written_tokens
            if any(ttl in cache.written_by_ttl for ttl in BREAKPOINT_TTLS):
                details["cache_write_tokens_details"] = {
                    f"ttl_{ttl}_tokens": cache.written_by_ttl.get(ttl, 0) for ttl in BREAKPOINT_TTLS
                }


def chat_usage(usage: dict, written_tokens: int) -> dict:
    """OpenAI's Chat Completions and Completions usage with the prompt tokens written to the cache."""
    details = usage.setdefault("prompt_tokens_details", {})
    details["cache_write_tokens"] = written_tokens
    return usage


def _anthropic_usage(usage: dict, cache: PromptCacheUsage, *, breakdown: bool) -> None:
    created_5m, created_1h = cache.written_by_ttl.get("5m", 0), cache.written_by_ttl.get("1h", 0)
    usage["cache_read_input_tokens"] = cache.read_tokens
    usage["cache_creation_input_tokens"] = created_5m + created_1h
    usage["input_tokens"] = cache.prompt_tokens - cache.read_tokens - created_5m - created_1h
    if breakdown:
        usage["cache_creation"] = {"ephemeral_5m_input_tokens": created_5m, "ephemeral_1h_input_tokens": created_1h}
