"""A request's output text: incremental detokenization, stop strings, and what may be streamed yet."""

from workers.protocol.sampling_params import SamplingParams
from workers.text.detokenizer import IncrementalDetokenizer
from workers.text.tokenizer import Tokenizer


class OutputText:
    """Text of one request's output as tokens arrive.

    While a stop string could still be forming at the end of the text, that tail is held back
    from the stream, so a client never receives text that a stop string later takes back.
    """

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=params.skip_special_tokens)
        self.stops = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.holdback = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.streamed = 0
        self.final: str | None = None

    def append(self, token_ids: list[int]) -> str | None:
        """Add generated tokens; return the stop string they completed, if any (the text ends there)."""
        searched = len(self.text)
        self.text += self.detokenizer.push(token_ids)
        match = self._find_stop(max(searched - self.holdback, 0))
        if match is None:
            return None
        index, stop = match
        self.final = self.text[: index + len(stop)] if self.include_stop else self.text[:index]
        return stop

    def finish(self) -> None:
        """No more tokens: release held-back bytes (the text is final)."""
        if self.final is None:
            self.text += self.detokenizer.flush()
            self.final = self.text

    def take_delta(self) -> str:
        """Text not yet streamed that can no longer change."""
        if self.final is not None:
            end = len(self.final)
            delta = self.final[self.streamed :]
        else:
            end = max(len(self.text) - self.holdback, self.streamed)
            delta = self.text[self.streamed : end]
        self.streamed = end
        return delta

    def _find_stop(self, start: int) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self.stops:
            index = self.text.find(stop, start)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        return best
