import json
from pathlib import Path

import pytest
import tokenizers

from tests.workers.engine.weights.conftest import CHAT_TEMPLATE, MERGES, SPECIAL_TOKENS, tiny_tokens
from workers.engine.weights import ModelFiles
from workers.engine.weights.gguf_tokenizer import tokenizer_from_gguf
from workers.protocol.errors import ModelLoadError

SOURCE = Path("tiny.gguf")

# The pre-tokenizer of HuggingFaceTB/SmolLM2-135M-Instruct's own tokenizer.json (StarCoder's).
SMOLLM2_PRE_TOKENIZER = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    ],
}


def tiny_metadata(**overrides: object) -> dict[str, object]:
    tokens = tiny_tokens()
    metadata: dict[str, object] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3] * len(SPECIAL_TOKENS) + [1] * (len(tokens) - len(SPECIAL_TOKENS)),
        "tokenizer.ggml.merges": list(MERGES),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.padding_token_id": 2,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHAT_TEMPLATE,
    }
    metadata.update(overrides)
    return metadata


def build(**overrides: object) -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_str(tokenizer_from_gguf(tiny_metadata(**overrides), source=SOURCE).tokenizer_json)


def test_control_tokens_become_special_added_tokens() -> None:
    added = build().get_added_tokens_decoder()

    assert {token_id: (token.content, token.special) for token_id, token in added.items()} == {
        0: ("<|endoftext|>", True),
        1: ("<|im_start|>", True),
        2: ("<|im_end|>", True),
    }


def test_user_defined_tokens_become_special_added_tokens() -> None:
    tokens = [*tiny_tokens(), "<think>"]
    types = [3, 3, 3] + [1] * (len(tokens) - 4) + [4]

    tokenizer = build(**{"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types})

    assert tokenizer.get_added_tokens_decoder()[len(tokens) - 1].special
    assert tokenizer.encode("a<think>b").ids[1] == len(tokens) - 1


def test_merges_apply() -> None:
    assert build().encode(" the").tokens == ["Ġthe"]


def test_smollm_splits_every_digit_and_gpt2_does_not() -> None:
    pieces = [piece for piece, _ in build().pre_tokenizer.pre_tokenize_str("a 12")]
    gpt2_pieces = [piece for piece, _ in build(**{"tokenizer.ggml.pre": "gpt2"}).pre_tokenizer.pre_tokenize_str("a 12")]

    assert pieces == ["a", "Ġ", "1", "2"]
    assert gpt2_pieces == ["a", "Ġ12"]


def test_tokenizer_config_names_special_tokens_and_template() -> None:
    config = tokenizer_from_gguf(tiny_metadata(), source=SOURCE).tokenizer_config

    assert config["bos_token"] == "<|im_start|>"
    assert config["eos_token"] == config["pad_token"] == "<|im_end|>"
    assert config["unk_token"] == "<|endoftext|>"
    assert config["chat_template"] == CHAT_TEMPLATE
    assert config["add_bos_token"] is False


def test_tokens_stored_in_plain_text_are_respelled_byte_level() -> None:
    tokens = [*tiny_tokens(), "a b"]

    vocab = build(**{"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": None}).get_vocab()

    assert vocab["aĠb"] == len(tokens) - 1


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("tokenizer.ggml.model", "t5", "tokenizer model 't5' is not supported"),
        ("tokenizer.ggml.pre", "qwen2", "pre-tokenizer 'qwen2' is not supported"),
        ("tokenizer.ggml.merges", None, "'tokenizer.ggml.merges' is missing"),
        ("tokenizer.ggml.merges", ["Ġt"], "merge 0"),
    ],
)
def test_unsupported_or_broken_metadata_is_named(key: str, value: object, message: str) -> None:
    with pytest.raises(ModelLoadError, match=message) as raised:
        tokenizer_from_gguf(tiny_metadata(**{key: value}), source=SOURCE)

    assert "tiny.gguf" in str(raised.value)


def test_duplicate_tokens_are_refused() -> None:
    metadata = tiny_metadata(**{"tokenizer.ggml.tokens": [*tiny_tokens(), "he"], "tokenizer.ggml.token_type": None})

    with pytest.raises(ModelLoadError, match="appears twice"):
        tokenizer_from_gguf(metadata, source=SOURCE)


@pytest.mark.slow
def test_smollm2_pre_tokenizer_is_the_original_one(smollm2_files: ModelFiles) -> None:
    converted = json.loads(smollm2_files.tokenizer_file.read_text())

    assert converted["pre_tokenizer"] == SMOLLM2_PRE_TOKENIZER
    assert converted["decoder"]["type"] == "ByteLevel"
    assert smollm2_files.tokenizer_config["add_bos_token"] is False
