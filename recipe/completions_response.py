"""Legacy Completions responses and stream chunks, in OpenAI's shape:

    {"id", "object": "text_completion", "created", "model", "system_fingerprint",
     "choices": [{"text", "index", "logprobs", "finish_reason"}], "usage"}

`logprobs` is {"tokens", "token_logprobs", "top_logprobs", "text_offset"}: one entry per token, the
alternatives as {token text: logprob} (the chosen token always among them, as OpenAI and vLLM do),
and each token's character offset in the choice's text. With `echo`, the prompt comes first, its
first token without a logprob. Tokens the detokenizer hides (end of sequence) are left out, so the
tokens spell the text.
"""

import codecs
from dataclasses import dataclass, field

from recipe.cache_usage import chat_usage
from recipe.prepared_request import SseEvent
from workers.protocol.logprobs import TokenLogprobs
from workers.protocol.messages import GenerateOutput
from workers.text.tokenizer import Tokenizer

FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "stop"}


@dataclass
class _Logprobs:
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def add(self, token: str, logprob: float | None, top: dict[str, float] | None, offset: int) -> None:
        self.tokens.append(token)
        self.token_logprobs.append(logprob)
        self.top_logprobs.append(top)
        self.text_offset.append(offset)

    def as_json(self) -> dict:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }


@dataclass
class _Choice:
    """One choice so far."""

    text: list[str] = field(default_factory=list)
    logprobs: _Logprobs = field(default_factory=_Logprobs)
    finish_reason: str | None = None
    started: bool = False
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    stored_tokens: int = 0
    # Offsets count characters: token bytes go through a UTF-8 decoder, so a character split over
    # tokens advances the offset where it completes.
    offset: int = 0
    offset_decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace")
    )


class CompletionsResponse:
    def __init__(
        self,
        *,
        response_id: str,
        created: int,
        model: str,
        n: int,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        echo_text: str | None,
        logprobs: bool,
        include_usage: bool,
    ) -> None:
        self._header = {"id": response_id, "object": "text_completion", "created": created, "model": model}
        self._choices = [_Choice() for _ in range(n)]
        self._tokenizer = tokenizer
        self._prompt_token_ids = prompt_token_ids
        self._echo_text = echo_text
        self._logprobs = logprobs
        self._include_usage = include_usage

    def push(self, choice: int, output: GenerateOutput) -> list[SseEvent]:
        state = self._choices[choice]
        delta_logprobs = _Logprobs()
        text = output.text
        if not state.started:
            state.started = True
            state.prompt_tokens = output.num_prompt_tokens
            state.cached_tokens = output.num_cached_tokens
            state.stored_tokens = output.num_stored_tokens
            if self._echo_text is not None:
                text = self._echo_text + text
                if self._logprobs:
                    self._add_prompt_logprobs(state, delta_logprobs, output.prompt_logprobs or [])
        state.completion_tokens += len(output.token_ids)
        if self._logprobs:
            for token_id, token_logprobs in zip(output.token_ids, output.logprobs, strict=False):
                if token_id not in self._tokenizer.special_token_ids:  # hidden from the text too
                    self._add_token(state, delta_logprobs, token_id, token_logprobs)
        state.text.append(text)
        finished = output.finish_reason is not None
        if finished:
            state.finish_reason = FINISH_REASONS[output.finish_reason]
        if not text and not delta_logprobs.tokens and not finished:
            return []
        chunk_choice = {
            "text": text,
            "index": choice,
            "logprobs": delta_logprobs.as_json() if self._logprobs else None,
            "finish_reason": state.finish_reason if finished else None,
        }
        chunk = {**self._header, "system_fingerprint": None, "choices": [chunk_choice]}
        if self._include_usage:
            chunk["usage"] = None
        return [SseEvent.of_json(chunk)]

    def finish(self) -> list[SseEvent]:
        events = []
        if self._include_usage:
            usage_chunk = {**self._header, "system_fingerprint": None, "choices": [], "usage": self._usage()}
            events.append(SseEvent.of_json(usage_chunk))
        events.append(SseEvent(None, "[DONE]"))
        return events

    def body(self) -> dict:
        choices = [
            {
                "text": "".join(state.text),
                "index": index,
                "logprobs": state.logprobs.as_json() if self._logprobs else None,
                "finish_reason": state.finish_reason,
            }
            for index, state in enumerate(self._choices)
        ]
        return {**self._header, "system_fingerprint": None, "choices": choices, "usage": self._usage()}

    def _usage(self) -> dict:
        first = self._choices[0]
        completion_tokens = sum(state.completion_tokens for state in self._choices)
        usage = {
            "prompt_tokens": first.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": first.prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": first.cached_tokens},
        }
        return chat_usage(usage, max(state.stored_tokens for state in self._choices))

    def _add_prompt_logprobs(
        self, state: _Choice, delta: _Logprobs, prompt_logprobs: list[TokenLogprobs | None]
    ) -> None:
        for position, token_id in enumerate(self._prompt_token_ids):
            # Entry 0 is None: the first prompt token has nothing before it to be predicted from.
            entry = prompt_logprobs[position] if position < len(prompt_logprobs) else None
            self._add_token(state, delta, token_id, entry)

    def _add_token(self, state: _Choice, delta: _Logprobs, token_id: int, logprobs: TokenLogprobs | None) -> None:
        token_bytes = self._tokenizer.token_bytes(token_id)
        token = _token_text(token_bytes)
        logprob = logprobs.logprob if logprobs is not None else None
        top = None
        if logprobs is not None:
            top = {_token_text(self._tokenizer.token_bytes(other)): value for other, value in logprobs.top}
            top.setdefault(token, logprobs.logprob)
        delta.add(token, logprob, top, state.offset)
        state.logprobs.add(token, logprob, top, state.offset)
        state.offset += len(state.offset_decoder.decode(token_bytes))


def _token_text(token_bytes: bytes) -> str:
    """A token's text; a token that is not whole UTF-8 (part of a character) as `\\xNN` escapes,
    the convention deepseek-recipe uses for Chat Completions logprobs."""
    try:
        return token_bytes.decode("utf-8")
    except UnicodeDecodeError:
        return "".join(f"\\x{byte:02x}" for byte in token_bytes)
