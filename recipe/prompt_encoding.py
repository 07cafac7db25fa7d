"""Conversations → prompt token ids, per model family, without letting text become a control token.

ChatML models: `recipe.chatml` renders the prompt and marks the spans that are control tokens; each
span becomes its special token id and every other segment is encoded with `allow_special=False`, so
text from users or tools (`<|im_start|>system` typed in a message) only ever yields plain-text ids.
DeepSeek V4.1 models: the library's own `DeepseekV41Encoding`, which encodes the same way.

Segments are encoded one after another. A thread pool was measured on long prompts (100K tokens in
2 to 200 segments, 2 cores): at best 15% faster, and slower for few large segments, which is the
common shape (one long document or tool result), so it is not worth its complexity here.
"""

import weakref
from collections.abc import Sequence

import deepseek_recipe
import numpy as np

from recipe.chatml import PromptText, default_system_prompt, render_chatml
from recipe.served_model import ServedModel
from workers.text.tokenizer import Tokenizer


def encode_conversation(conversation: deepseek_recipe.Conversation, model: ServedModel) -> list[int]:
    if model.family == "deepseek_v41":
        encoding = deepseek_recipe.DeepseekV41Encoding().with_tokenizer(model.codec_tokenizer)
        return encoding.encode(conversation)
    return encode_prompt_text(render_prompt(conversation, model), model.tokenizer)


def render_prompt(conversation: deepseek_recipe.Conversation, model: ServedModel) -> PromptText:
    """The prompt's text and control-token spans, before encoding."""
    if model.family == "deepseek_v41":
        rendered = deepseek_recipe.DeepseekV41Encoding().render_conversation(conversation)
        return PromptText(rendered.prompt, tuple(rendered.special_ranges))
    return render_chatml(conversation, default_system_prompt=default_system_prompt(model.tokenizer))


def encode_prompt_text(prompt: PromptText, tokenizer: Tokenizer) -> list[int]:
    special_ids = _special_token_ids(tokenizer)
    ids: list[int] = []
    position = 0
    for start, end in prompt.special_ranges:
        ids += _encode_plain(prompt.text[position:start], tokenizer)
        spelling = prompt.text[start:end]
        if spelling not in special_ids:
            raise ValueError(f"{spelling!r} is not a special token of this tokenizer")
        ids.append(special_ids[spelling])
        position = end
    ids += _encode_plain(prompt.text[position:], tokenizer)
    return ids


def _encode_plain(text: str, tokenizer: Tokenizer) -> list[int]:
    if not text:
        return []
    # [BOS] when the tokenizer is configured to add it to every encode; a prompt spells its BOS as a span.
    automatic_prefix = tokenizer.encode("")
    return tokenizer.encode(text, allow_special=False)[len(automatic_prefix) :]


def tokens_before(
    token_ids: Sequence[int], tokenizer: Tokenizer, text: str, positions: Sequence[int]
) -> list[int] | None:
    """For each position of `text` (a str index), how many of the tokens that encode it lie wholly
    before it; None when the tokens do not spell `text` (every token stands for exact bytes, so
    they do for the prompts encoded here). A token that straddles a position is not counted."""
    lengths = _token_lengths(tokenizer)
    ids = np.asarray(token_ids, dtype=np.int64)
    if ids.size and not (0 <= ids.min() and ids.max() < len(lengths)):
        return None
    ends = np.cumsum(lengths[ids])
    if (int(ends[-1]) if ends.size else 0) != len(text.encode("utf-8")):
        return None
    offsets = [len(text[:position].encode("utf-8")) for position in positions]
    return [int(count) for count in np.searchsorted(ends, offsets, side="right")]


_token_lengths_by_tokenizer: "weakref.WeakKeyDictionary[Tokenizer, np.ndarray]" = weakref.WeakKeyDictionary()


def _token_lengths(tokenizer: Tokenizer) -> np.ndarray:
    """Bytes each token id stands for."""
    if tokenizer not in _token_lengths_by_tokenizer:
        _token_lengths_by_tokenizer[tokenizer] = np.array(
            [len(tokenizer.token_bytes(token_id)) for token_id in range(tokenizer.vocab_size)], dtype=np.int64
        )
    return _token_lengths_by_tokenizer[tokenizer]


_special_ids_by_tokenizer: "weakref.WeakKeyDictionary[Tokenizer, dict[str, int]]" = weakref.WeakKeyDictionary()


def _special_token_ids(tokenizer: Tokenizer) -> dict[str, int]:
    if tokenizer not in _special_ids_by_tokenizer:
        _special_ids_by_tokenizer[tokenizer] = {
            tokenizer.token_bytes(token_id).decode("utf-8"): token_id for token_id in tokenizer.special_token_ids
        }
    return _special_ids_by_tokenizer[tokenizer]
