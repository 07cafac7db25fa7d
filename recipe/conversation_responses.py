"""How a converted Chat Completions, Responses or Messages request is answered: which way its
choices feed deepseek-recipe's stream processor, and the ResponseBuilder for its protocol.

Tools and logprobs: a ChatML model's tool calls are only recognised in text (recipe.tool_calls),
while the library builds `logprobs` only from token chunks (recipe.codec_stream). When both are
asked, tool calls win and the response carries no logprobs: a missed tool call breaks the client's
tool loop, missing logprobs only leave a field empty. DeepSeek models get both, since their tool
markup is in the tokens.
"""

from dataclasses import dataclass
from typing import Literal

import deepseek_recipe

from recipe.cache_hints import CacheRequest
from recipe.cache_usage import MessagesUsageReport, ResponsesUsageReport
from recipe.codec_response import ChatCompletionsResponse, SingleChoiceResponse
from recipe.codec_stream import ChoiceFeed
from recipe.prepared_request import ResponseBuilder
from recipe.served_model import ServedModel


def choice_feed(
    converted: deepseek_recipe.ConversationRequest,
    conversation: deepseek_recipe.Conversation,
    model: ServedModel,
    *,
    forces_tool_call: bool,
) -> ChoiceFeed:
    """forces_tool_call: the prompt ends inside an opened tool call (tool choice required)."""
    parsing = converted.parsing_options
    if model.family == "deepseek_v41":
        return ChoiceFeed(
            parsing_options=_processor_options(
                parsing, starts_in_tool_calls=forces_tool_call, thinking=parsing.thinking_initial_stage
            ),
            codec_tokenizer=model.codec_tokenizer,
            mode="tokens",
            hidden_token_ids=model.tokenizer.eos_token_ids,
            adapts_tool_calls=False,
            starts_in_tool_call=False,
        )
    tools_active = parsing.parse_tool_calls and bool(conversation.tools)
    return ChoiceFeed(
        # The adapter writes the whole DSML calls block, opener included; ChatML models here do
        # not think, so a request for thinking is answered plainly.
        parsing_options=_processor_options(parsing, starts_in_tool_calls=False, thinking=None),
        codec_tokenizer=model.codec_tokenizer,
        mode="tokens" if converted.inference_options.logprobs and not tools_active else "text",
        hidden_token_ids=model.tokenizer.special_token_ids,
        adapts_tool_calls=tools_active,
        starts_in_tool_call=forces_tool_call,
    )


def _processor_options(
    parsing: deepseek_recipe.ParsingOptions,
    *,
    starts_in_tool_calls: bool,
    thinking: deepseek_recipe.ThinkingInitialStage | None,
) -> deepseek_recipe.ParsingOptions:
    return deepseek_recipe.ParsingOptions(
        parse_tool_calls=parsing.parse_tool_calls,
        starts_in_tool_calls=starts_in_tool_calls,
        parse_json_output=parsing.parse_json_output,
        thinking_initial_stage=thinking,
        stop_sequences=parsing.stop_sequences,
        special_tokens=parsing.special_tokens,
    )


@dataclass(frozen=True)
class ConversationResponseFactory:
    protocol: Literal["chat.completions", "responses", "messages"]
    converted: deepseek_recipe.ConversationRequest
    model_name: str
    feed: ChoiceFeed
    n: int
    include_usage: bool
    responses_echo: deepseek_recipe.ResponsesEcho | None
    namespace_tools: dict[str, tuple[str, str]]
    cache: CacheRequest
    cache_ttls: tuple[str, ...]  # the API's name of each engine cache hint's lifetime, in order

    def new_response(self, response_id: str, created: int) -> ResponseBuilder:
        if self.protocol == "chat.completions":
            return ChatCompletionsResponse(
                self.feed,
                n=self.n,
                new_generator=lambda: deepseek_recipe.ChatCompletionRequest.chunk_generator(
                    self.converted, response_id, self.model_name
                ),
                response_id=response_id,
                model=self.model_name,
                created=created,
                include_usage=self.include_usage,
            )
        if self.protocol == "responses":
            generator = deepseek_recipe.ResponsesRequest.chunk_generator(self.converted, response_id, self.model_name)
            if self.responses_echo is not None:
                generator = generator.with_echo(self.responses_echo)
            if self.namespace_tools:
                generator = generator.with_namespace_tool_map(self.namespace_tools)
            accumulator = deepseek_recipe.ResponsesResponse(response_id, self.model_name, created, 0, 0)
            report = ResponsesUsageReport(
                self.cache.prompt_cache_key, self.cache.prompt_cache_retention, self.cache.prompt_cache_options
            )
            return SingleChoiceResponse(
                self.feed, generator=generator, accumulator=accumulator, report=report, cache_ttls=self.cache_ttls
            )
        generator = deepseek_recipe.MessagesRequest.chunk_generator(self.converted, response_id, self.model_name)
        accumulator = deepseek_recipe.MessagesResponse(response_id, self.model_name, created, 0, 0)
        return SingleChoiceResponse(
            self.feed,
            generator=generator,
            accumulator=accumulator,
            report=MessagesUsageReport(),
            cache_ttls=self.cache_ttls,
        )
