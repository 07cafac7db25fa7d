"""Rebuilds a Hugging Face `tokenizer.json` and `tokenizer_config.json` from GGUF tokenizer metadata.

A GGUF file stores the vocabulary and merges under llama.cpp's keys (`tokenizer.ggml.*`) and names the
pre-tokenizer only by a tag (`tokenizer.ggml.pre`); the split rules themselves live in llama.cpp's
source. We support the byte-level BPE vocabularies we can vouch for and Gemma's SentencePiece BPE
(gguf_sentencepiece), and refuse the rest by name rather than tokenize differently from the model's
own tokenizer.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from workers.engine.weights.gguf_sentencepiece import CONTROL_TOKEN_TYPE, USER_DEFINED_TOKEN_TYPE, sentencepiece_bpe
from workers.protocol.errors import ModelLoadError

# Tokens llama.cpp treats as ending generation besides the eos id (llama-vocab.cpp): a GGUF names
# one eos id, but chat models also stop on their end-of-turn and end-of-text tokens.
END_OF_GENERATION_TEXTS = frozenset(
    {
        "<|endoftext|>",
        "<|im_end|>",
        "<|eot_id|>",
        "<|eom_id|>",
        "<|end|>",
        "<end_of_turn>",
        "<|end_of_text|>",
        "<EOT>",
        "<|return|>",
        "<｜end▁of▁sentence｜>",
    }
)


# tokenizer_config.json's special token → the GGUF key holding its id.
SPECIAL_TOKEN_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def _gpt2_byte_level() -> pre_tokenizers.ByteLevel:
    """GPT-2's split regex, then every byte spelled as one character of the byte-level alphabet."""
    return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)


# `tokenizer.ggml.pre` → the pre-tokenizer of the model's original tokenizer.json.
# smollm: SmolLM2's own tokenizer.json splits every digit on its own and then applies GPT-2's
# byte-level regex (as StarCoder's does); llama.cpp's "smollm" regexes, \p{N} then GPT-2's, agree.
PRE_TOKENIZERS = {
    "gpt2": _gpt2_byte_level,
    "smollm": lambda: pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2_byte_level()]),
}


@dataclass(frozen=True, slots=True)
class GgufTokenizer:
    tokenizer_json: str  # the serialized `tokenizers.Tokenizer`
    tokenizer_config: dict  # Hugging Face tokenizer_config.json
    end_of_generation_ids: tuple[int, ...]  # ids that end a generated turn, for generation_config.json


def tokenizer_from_gguf(metadata: Mapping[str, object], *, source: Path) -> GgufTokenizer:
    """`metadata` maps GGUF keys to their values; `source` names the file in error messages."""
    tokenizer_model = metadata.get("tokenizer.ggml.model")
    builders = {"gpt2": _byte_level_bpe, "llama": sentencepiece_bpe}
    if tokenizer_model not in builders:
        raise ModelLoadError(
            f"{source}: tokenizer model {tokenizer_model!r} is not supported "
            "(supported: 'gpt2', byte-level BPE; 'llama', SentencePiece BPE)"
        )
    tokens = _string_list(metadata, "tokenizer.ggml.tokens", source)
    token_types = list(metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if len(token_types) != len(tokens):
        raise ModelLoadError(f"{source}: {len(tokens)} tokens but {len(token_types)} token types")
    tokenizer = builders[tokenizer_model](metadata, tokens, token_types, source)
    return GgufTokenizer(
        tokenizer_json=tokenizer.to_str(),
        tokenizer_config=_tokenizer_config(metadata, tokens),
        end_of_generation_ids=_end_of_generation_ids(metadata, tokens, token_types),
    )


def _byte_level_bpe(
    metadata: Mapping[str, object], tokens: list[str], token_types: list[int], source: Path
) -> Tokenizer:
    pre_type = metadata.get("tokenizer.ggml.pre")
    if pre_type not in PRE_TOKENIZERS:
        raise ModelLoadError(
            f"{source}: pre-tokenizer {pre_type!r} is not supported (supported: {', '.join(sorted(PRE_TOKENIZERS))})"
        )
    merges = _string_list(metadata, "tokenizer.ggml.merges", source)
    added = [
        token
        for token, token_type in zip(tokens, token_types)
        if token_type in (CONTROL_TOKEN_TYPE, USER_DEFINED_TOKEN_TYPE)
    ]
    tokenizer = Tokenizer(
        models.BPE(
            vocab=_byte_level_vocab(tokens, frozenset(added), source),
            merges=_merge_pairs(merges, source),
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tokenizer.pre_tokenizer = PRE_TOKENIZERS[pre_type]()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in added])
    return tokenizer


def _string_list(metadata: Mapping[str, object], key: str, source: Path) -> list[str]:
    value = metadata.get(key)
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ModelLoadError(f"{source}: metadata {key!r} is missing or not a list of strings")
    return value


def _byte_level_vocab(tokens: Sequence[str], added: frozenset[str], source: Path) -> dict[str, int]:
    # Ordinary tokens must be spelled in the byte-level alphabet (a space is "Ġ"); some converters
    # store a few in plain text, so respell those. Added tokens keep their text: that is what
    # the added-token matcher looks up in the vocabulary.
    alphabet = frozenset(pre_tokenizers.ByteLevel.alphabet())
    respell = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    vocab: dict[str, int] = {}
    for token_id, token in enumerate(tokens):
        if token not in added and not set(token) <= alphabet:
            token = "".join(piece for piece, _ in respell.pre_tokenize_str(token))
        if token in vocab:
            raise ModelLoadError(f"{source}: token {token!r} appears twice (ids {vocab[token]} and {token_id})")
        vocab[token] = token_id
    return vocab


def _merge_pairs(merges: Sequence[str], source: Path) -> list[tuple[str, str]]:
    pairs = []
    for rank, merge in enumerate(merges):
        parts = merge.split(" ")
        if len(parts) != 2:
            raise ModelLoadError(f"{source}: merge {rank} ({merge!r}) is not two space-separated tokens")
        pairs.append((parts[0], parts[1]))
    return pairs


def _token_id(metadata: Mapping[str, object], key: str, tokens: Sequence[str]) -> int | None:
    token_id = metadata.get(key)
    return token_id if isinstance(token_id, int) and 0 <= token_id < len(tokens) else None


def _tokenizer_config(metadata: Mapping[str, object], tokens: Sequence[str]) -> dict:
    config: dict[str, object] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    for role, key in SPECIAL_TOKEN_KEYS.items():
        if (token_id := _token_id(metadata, key, tokens)) is not None:
            config[role] = tokens[token_id]
    chat_template = metadata.get("tokenizer.chat_template")
    if isinstance(chat_template, str):
        config["chat_template"] = chat_template
    config["add_bos_token"] = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
    config["add_eos_token"] = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    return config


def _end_of_generation_ids(
    metadata: Mapping[str, object], tokens: Sequence[str], token_types: Sequence[int]
) -> tuple[int, ...]:
    named = {
        token_id
        for key in ("eos_token_id", "eot_token_id", "eom_token_id")
        if (token_id := _token_id(metadata, f"tokenizer.ggml.{key}", tokens)) is not None
    }
    by_text = {
        token_id
        for token_id, (token, token_type) in enumerate(zip(tokens, token_types))
        if token_type == CONTROL_TOKEN_TYPE and token in END_OF_GENERATION_TEXTS
    }
    return tuple(sorted(named | by_text))
