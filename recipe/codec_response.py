"""ResponseBuilders for the protocols deepseek-recipe renders: Chat Completions (n choices), and
Responses and Messages (one choice).

The library renders one choice per processor. For Chat Completions this module makes the n streams
one response: each chunk gets its choice's index and the response's `created`; usage leaves the
finish chunks and, when `stream_options.include_usage` asks for it, comes once at the end in a chunk
of its own with empty choices (the library would put it on every choice's last chunk); prompt-side
counts come from choice 0 and completion tokens are summed over the choices; the prompt tokens
written to the cache are the most any choice wrote (recipe.cache_usage).
"""

import json
from collections.abc import Callable, Sequence

import deepseek_recipe

from recipe.cache_usage import UsageReport, chat_usage
from recipe.codec_stream import Accumulator, ChoiceFeed, ChoiceStream, Generator
from recipe.prepared_request import SseEvent
from workers.protocol.messages import GenerateOutput


class ChatCompletionsResponse:
    def __init__(
        self,
        feed: ChoiceFeed,
        *,
        n: int,
        new_generator: Callable[[], Generator],
        response_id: str,
        model: str,
        created: int,
        include_usage: bool,
    ) -> None:
        self._choices = [
            ChoiceStream(
                feed, new_generator(), deepseek_recipe.ChatCompletionResponse(response_id, model, created, 0, 0)
            )
            for _ in range(n)
        ]
        self._response_id = response_id
        self._model = model
        self._created = created
        self._include_usage = include_usage

    def push(self, choice: int, output: GenerateOutput) -> list[SseEvent]:
        return [self._event(choice, chunk) for chunk in self._choices[choice].push(output)]

    def finish(self) -> list[SseEvent]:
        events = []
        if self._include_usage:
            usage_chunk = {
                "id": self._response_id,
                "object": "chat.completion.chunk",
                "created": self._created,
                "model": self._model,
                "system_fingerprint": None,
                "choices": [],
                "usage": self._usage([choice.body() for choice in self._choices]),
            }
            events.append(SseEvent.of_json(usage_chunk))
        done = deepseek_recipe.ChatCompletionResponse.sse_done_data()
        if done is not None:
            events.append(SseEvent(None, done))
        return events

    def body(self) -> dict:
        bodies = [choice.body() for choice in self._choices]
        merged = bodies[0]
        merged["choices"] = [{**body["choices"][0], "index": index} for index, body in enumerate(bodies)]
        merged["usage"] = self._usage(bodies)
        return merged

    def _event(self, choice: int, chunk: SseEvent) -> SseEvent:
        data = json.loads(chunk.data)
        data["created"] = self._created  # the library stamps chunks with its own clock
        for entry in data["choices"]:
            entry["index"] = choice
        if self._include_usage:
            data["usage"] = None  # OpenAI: null on every chunk but the final usage chunk
        else:
            data.pop("usage", None)
        return SseEvent.of_json(data)  # Chat chunks are unnamed events

    def _usage(self, bodies: list[dict]) -> dict:
        usage = dict(bodies[0]["usage"])
        usage["completion_tokens"] = sum(body["usage"]["completion_tokens"] for body in bodies)
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        # Choices that ran at once may each have found the prompt's blocks written by another.
        written = max(choice.cache.written_tokens if choice.cache is not None else 0 for choice in self._choices)
        return chat_usage(usage, written)


class SingleChoiceResponse:
    """Responses and Messages: the library's events and body, with the prompt cache in their usage."""

    def __init__(
        self,
        feed: ChoiceFeed,
        *,
        generator: Generator,
        accumulator: Accumulator,
        report: UsageReport,
        cache_ttls: Sequence[str],
    ) -> None:
        self._choice = ChoiceStream(feed, generator, accumulator, report=report, cache_ttls=cache_ttls)
        self._accumulator_type = type(accumulator)

    def push(self, choice: int, output: GenerateOutput) -> list[SseEvent]:
        if choice != 0:
            raise ValueError(f"this protocol has one choice, got output for choice {choice}")
        return self._choice.push(output)

    def finish(self) -> list[SseEvent]:
        done = self._accumulator_type.sse_done_data()
        return [SseEvent(None, done)] if done is not None else []

    def body(self) -> dict:
        return self._choice.body()
