"""Turns a stream of generated token ids into text as it completes.

A token can end in the middle of a UTF-8 character (CJK and emoji are often split across tokens), so
we feed each token's exact bytes to an incremental UTF-8 decoder, which holds back an incomplete
sequence until the bytes that finish it arrive. The work per token is constant, and the text matches
`Tokenizer.decode` of all the ids at once.
"""

import codecs
from collections.abc import Sequence

from workers.text.tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skipped_ids = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        # errors="replace" is what decode() does with invalid bytes (tokenizers decodes lossily).
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pieces: list[str] = []

    def push(self, token_ids: Sequence[int]) -> str:
        """The text newly completed by these tokens."""
        data = b"".join(
            self._tokenizer.token_bytes(token_id) for token_id in token_ids if token_id not in self._skipped_ids
        )
        return self._emit(self._decoder.decode(data))

    def flush(self) -> str:
        """At the end of the stream: whatever was held back, with invalid bytes as U+FFFD."""
        return self._emit(self._decoder.decode(b"", final=True))

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def _emit(self, text: str) -> str:
        if text:
            self._pieces.append(text)
        return text
