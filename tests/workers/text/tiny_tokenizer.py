"""A tiny byte-level tokenizer built in memory (fast), for tests that need a tokenizer but not the real one."""

from pathlib import Path

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from workers.text.tokenizer import Tokenizer

TINY_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tiny_tokenizer_json() -> str:
    """Three special tokens, one token per byte, and two merges ("Ġt", "he")."""
    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: token_id for token_id, token in enumerate([*TINY_SPECIAL_TOKENS, *byte_chars, "Ġt", "he"])}
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=[("Ġ", "t"), ("h", "e")]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in TINY_SPECIAL_TOKENS])
    return backend.to_str()


def make_tiny_tokenizer(
    *,
    tokenizer_config: dict | None = None,
    generation_config: dict | None = None,
    chat_template: str | None = TINY_CHAT_TEMPLATE,
) -> Tokenizer:
    default_config = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
    return Tokenizer(
        tokenizer_json=tiny_tokenizer_json(),
        tokenizer_config=default_config if tokenizer_config is None else tokenizer_config,
        generation_config={"eos_token_id": [0, 2]} if generation_config is None else generation_config,
        chat_template=chat_template,
        source=Path("tiny/tokenizer.json"),
    )
