"""One choice of a Chat Completions, Responses or Messages response: engine outputs → deepseek-recipe
inference chunks → the library's protocol events, accumulated into the non-stream body as they pass.

Two ways to feed the library's StreamProcessor:
- text chunks: the engine's detokenized text (stop strings included, see recipe.conversation_requests), through
  the tool-call adapter when the model writes ChatML tool calls;
- token chunks: the token ids with their logprobs, decoded by the processor with the library's
  tokenizer. Used when logprobs are asked (the library builds `logprobs` only from token chunks),
  and always for DeepSeek models, whose DSML tool-call markup is made of special tokens that the
  engine's detokenizer skips. Ids the detokenizer would have hidden are left out here too.
A choice uses one way from start to end (`ChoiceFeed`).
"""

import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Literal

import deepseek_recipe

from recipe.cache_usage import PromptCacheUsage, UsageReport, reported
from recipe.prepared_request import SseEvent
from recipe.tool_calls import ToolCallAdapter
from workers.protocol.messages import GenerateOutput

Generator = (
    deepseek_recipe.ChatCompletionChunkGenerator
    | deepseek_recipe.ResponsesChunkGenerator
    | deepseek_recipe.MessagesChunkGenerator
)
Accumulator = (
    deepseek_recipe.ChatCompletionResponse | deepseek_recipe.ResponsesResponse | deepseek_recipe.MessagesResponse
)
Event = deepseek_recipe.ChatCompletionChunk | deepseek_recipe.ResponsesStreamEvent | deepseek_recipe.MessagesStreamEvent

FINISH_REASONS = {
    "stop": deepseek_recipe.InferenceFinishReason.Stop,
    "length": deepseek_recipe.InferenceFinishReason.Length,
    # An aborted request that still gets rendered ends as it stands.
    "abort": deepseek_recipe.InferenceFinishReason.Stop,
}


@dataclass(frozen=True)
class ChoiceFeed:
    """How a request's choices feed their processors; the same for every choice."""

    parsing_options: deepseek_recipe.ParsingOptions
    codec_tokenizer: deepseek_recipe.Tokenizer
    mode: Literal["text", "tokens"]
    hidden_token_ids: Collection[int]  # tokens mode: ids left out (those the detokenizer skips)
    adapts_tool_calls: bool  # text mode: ChatML tool calls → DSML
    starts_in_tool_call: bool  # the prompt opened the first tool call


class ChoiceStream:
    def __init__(
        self,
        feed: ChoiceFeed,
        generator: Generator,
        accumulator: Accumulator,
        *,
        report: UsageReport | None = None,
        cache_ttls: Sequence[str] = (),
    ) -> None:
        """`report` adds the prompt cache to the protocol's usage; `cache_ttls` name the lifetimes of
        the request's cache hints, in order (recipe.cache_usage)."""
        self._feed = feed
        self._report = report
        self._cache_ttls = cache_ttls
        # What the prompt did with the cache, from the first output on.
        self.cache: PromptCacheUsage | None = None
        self._processor = deepseek_recipe.StreamProcessor(generator, feed.parsing_options, feed.codec_tokenizer)
        self._accumulator = accumulator
        self._accumulator_type = type(accumulator)
        self._adapter = (
            ToolCallAdapter(
                starts_in_tool_call=feed.starts_in_tool_call,
                dsml=feed.parsing_options.special_tokens.token(deepseek_recipe.SpecialToken.Dsml),
            )
            if feed.adapts_tool_calls
            else None
        )
        self._started = False
        # Tokens whose text is not out yet: they are counted with the next text pushed, because an
        # empty text chunk would show up as an empty delta (or open an empty content block).
        self._uncounted_tokens = 0

    def push(self, output: GenerateOutput) -> list[SseEvent]:
        """The protocol events this output produces (accumulating them consumes them, so they are
        serialized first)."""
        events: list[Event] = []
        if not self._started:
            self._started = True
            self.cache = PromptCacheUsage.of(output, self._cache_ttls)
            usage = deepseek_recipe.PromptUsage(
                prompt_tokens=output.num_prompt_tokens, prompt_cache_hit_tokens=output.num_cached_tokens
            )
            events += self._processor.push(deepseek_recipe.InferenceChunk.ready(prompt_usage=usage))
        finished = output.finish_reason is not None
        content = self._token_chunks(output) if self._feed.mode == "tokens" else self._text_chunks(output, finished)
        for chunk in content:
            events += self._push(chunk)
        if finished:
            if self._uncounted_tokens:
                events += self._push(deepseek_recipe.InferenceChunk.text("", self._uncounted_tokens))
            events += self._push(deepseek_recipe.InferenceChunk.finish(FINISH_REASONS[output.finish_reason]))
            events += self._processor.finish()
        serialized = []
        for event in events:
            rendered = SseEvent(self._accumulator_type.sse_event_name(event), event.to_json())
            serialized.append(reported(rendered, self._report, self.cache))
            self._accumulator.accumulate(event)
        return serialized

    def body(self) -> dict:
        body = json.loads(self._accumulator.to_json())
        if self._report is not None and self.cache is not None:
            self._report.body(body, self.cache)
        return body

    def _push(self, chunk: deepseek_recipe.InferenceChunk) -> list[Event]:
        # A stop sequence finishes the processor early; what the engine sent after it is moot.
        return [] if self._processor.finished else self._processor.push(chunk)

    def _text_chunks(self, output: GenerateOutput, finished: bool) -> list[deepseek_recipe.InferenceChunk]:
        text = output.text
        if self._adapter is not None:
            text = self._adapter.push(text) + (self._adapter.finish() if finished else "")
        self._uncounted_tokens += len(output.token_ids)
        if not text:
            return []
        chunk = deepseek_recipe.InferenceChunk.text(text, self._uncounted_tokens)
        self._uncounted_tokens = 0
        return [chunk]

    def _token_chunks(self, output: GenerateOutput) -> list[deepseek_recipe.InferenceChunk]:
        hidden = self._feed.hidden_token_ids
        shown = [index for index, token_id in enumerate(output.token_ids) if token_id not in hidden]
        self._uncounted_tokens += len(output.token_ids) - len(shown)
        if not shown:
            return []
        token_ids = [output.token_ids[index] for index in shown]
        if not output.logprobs:
            return [deepseek_recipe.InferenceChunk.tokens(token_ids)]
        logprobs = [(output.logprobs[index].logprob, output.logprobs[index].top) for index in shown]
        return [deepseek_recipe.InferenceChunk.tokens(token_ids, logprobs)]
