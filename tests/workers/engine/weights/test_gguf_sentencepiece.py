"""Gemma's SentencePiece vocabulary from GGUF metadata: merges ranked by the order pieces are listed
in, and what is refused by name."""

from pathlib import Path

import pytest
import tokenizers

from tests.workers.engine.weights.tiny_gemma3_gguf import BYTES, CONTROL, TOKEN_TYPES, USER_DEFINED
from workers.engine.weights.gguf_tokenizer import tokenizer_from_gguf
from workers.protocol.errors import ModelLoadError

SOURCE = Path("tiny-gemma.gguf")


def metadata(normal: list[str], **overrides: object) -> dict[str, object]:
    tokens = [*CONTROL, *USER_DEFINED, *BYTES, *normal]
    fields: dict[str, object] = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [TOKEN_TYPES.get(token, 1) for token in tokens],
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.unknown_token_id": 3,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_space_prefix": False,
    }
    return {**fields, **overrides}


def pieces(normal: list[str], text: str) -> list[str]:
    built = tokenizer_from_gguf(metadata(normal), source=SOURCE)
    return tokenizers.Tokenizer.from_str(built.tokenizer_json).encode(text).tokens


def test_the_piece_listed_first_merges_first() -> None:
    letters = ["▁", "t", "h", "e"]

    assert pieces([*letters, "th", "he"], "the") == ["th", "e"]
    assert pieces([*letters, "he", "th"], "the") == ["t", "he"]
    assert pieces([*letters, "he", "th", "▁t", "▁the"], " the") == ["▁the"]


def test_unknown_characters_fall_back_to_bytes_and_spaces_are_not_prefixed() -> None:
    assert pieces(["▁", "a"], "a é") == ["a", "▁", "<0xC3>", "<0xA9>"]


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"tokenizer.ggml.add_space_prefix": True}, "add_space_prefix"),
        ({"tokenizer.ggml.add_space_prefix": None}, "add_space_prefix"),
        ({"tokenizer.ggml.unknown_token_id": None}, "unknown_token_id"),
    ],
)
def test_unsupported_metadata_is_named(change: dict, named: str) -> None:
    with pytest.raises(ModelLoadError, match=named):
        tokenizer_from_gguf(metadata(["▁", "a"], **change), source=SOURCE)


def test_a_piece_of_spaces_and_its_marked_spelling_are_one_token_twice() -> None:
    # llama.cpp writes "▁▁" as two spaces; a file holding both spellings names one piece twice.
    with pytest.raises(ModelLoadError, match="appears twice"):
        tokenizer_from_gguf(metadata(["▁", "▁▁"]), source=SOURCE)
