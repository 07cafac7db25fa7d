import random

import pytest

from workers.text.detokenizer import IncrementalDetokenizer
from workers.text.tokenizer import Tokenizer

MULTILINGUAL_TEXT = (
    "Hello! Grüße aus München. Привет, мир. 日本語のテキストと中文文本，한국어 텍스트. "
    "Emoji: 😀👍🏽🇺🇸 ❤️ 👨‍👩‍👧 and math: ∑ x² ≤ ½."
)


def stream(
    tokenizer: Tokenizer, ids: list[int], *, skip_special_tokens: bool = True, chunk: int = 1
) -> tuple[list[str], str]:
    """The pieces push() returned, chunk ids at a time, and what flush() returned."""
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    pieces = [detokenizer.push(ids[start : start + chunk]) for start in range(0, len(ids), chunk)]
    final = detokenizer.flush()
    assert detokenizer.text == "".join(pieces) + final
    return pieces, final


def byte_token(tokenizer: Tokenizer, byte: int) -> int:
    wanted = bytes([byte])
    return next(token_id for token_id in range(tokenizer.vocab_size) if tokenizer.token_bytes(token_id) == wanted)


def test_a_character_split_across_tokens_is_held_back_until_complete(tiny_tokenizer: Tokenizer) -> None:
    ids = [byte_token(tiny_tokenizer, byte) for byte in "a你😀".encode()]

    pieces, final = stream(tiny_tokenizer, ids)

    assert pieces == ["a", "", "", "你", "", "", "", "😀"]
    assert final == ""


def test_an_incomplete_sequence_at_the_end_becomes_a_replacement_character(tiny_tokenizer: Tokenizer) -> None:
    ids = [byte_token(tiny_tokenizer, byte) for byte in b"ok\xe4\xbd"]

    pieces, final = stream(tiny_tokenizer, ids)

    assert "".join(pieces) == "ok"
    assert final == "\ufffd" == tiny_tokenizer.decode(ids)[2:]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_byte_sequences_match_decode(tiny_tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
    generator = random.Random(7)
    for _ in range(300):
        ids = [generator.randrange(tiny_tokenizer.vocab_size) for _ in range(generator.randrange(1, 24))]

        pieces, final = stream(tiny_tokenizer, ids, skip_special_tokens=skip_special_tokens)

        assert "".join(pieces) + final == tiny_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens), ids


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [1, 3])
def test_smollm2_multilingual_text_streams_exactly(smollm2_tokenizer: Tokenizer, chunk: int) -> None:
    ids = smollm2_tokenizer.encode(MULTILINGUAL_TEXT)
    # The text must exercise the hold-back: some tokens end inside a character.
    assert any(not _is_utf8(smollm2_tokenizer.token_bytes(token_id)) for token_id in ids)

    pieces, final = stream(smollm2_tokenizer, ids, chunk=chunk)

    assert "".join(pieces) == MULTILINGUAL_TEXT
    assert final == ""
    assert not any("\ufffd" in piece for piece in pieces)
    if chunk == 1:
        assert "" in pieces


@pytest.mark.slow
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_smollm2_special_tokens_follow_the_skip_flag(smollm2_tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
    ids = smollm2_tokenizer.encode("<|im_start|>assistant\nSure 😀<|im_end|>", allow_special=True)

    pieces, final = stream(smollm2_tokenizer, ids, skip_special_tokens=skip_special_tokens)

    expected = "assistant\nSure 😀" if skip_special_tokens else "<|im_start|>assistant\nSure 😀<|im_end|>"
    assert "".join(pieces) + final == expected == smollm2_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.slow
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_smollm2_random_ids_match_decode(smollm2_tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
    generator = random.Random(11)
    # Half the ids from the low range, where the special and single-byte tokens are.
    for _ in range(300):
        ids = [
            generator.randrange(300) if generator.random() < 0.5 else generator.randrange(smollm2_tokenizer.vocab_size)
            for _ in range(generator.randrange(1, 40))
        ]

        pieces, final = stream(smollm2_tokenizer, ids, skip_special_tokens=skip_special_tokens)

        assert "".join(pieces) + final == smollm2_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens), ids


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
