"""Gemma's SentencePiece BPE vocabulary (`tokenizer.ggml.model` "llama") as a `tokenizers` BPE, the
shape of Gemma's own tokenizer.json: spaces written "▁" by a normalizer, no pre-tokenizer and no
prefix space, characters outside the vocabulary spelled as byte tokens (<0x0A>), and a decoder that
turns "▁" back into spaces and byte tokens into bytes.

llama.cpp stores such a vocabulary without merges: SentencePiece merges by piece rank, best first,
which is the order the pieces are listed in. A merge per way of cutting a piece in two known pieces,
ranked by the piece's position, does the same; ties within a piece go to the longer left part, as
transformers' GGUF reader ranks them too.
"""

from collections.abc import Mapping
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

from workers.protocol.errors import ModelLoadError

# llama.cpp's token types (gguf TokenType).
NORMAL_TOKEN_TYPE = 1
CONTROL_TOKEN_TYPE = 3
USER_DEFINED_TOKEN_TYPE = 4
SPACE_MARK = "▁"


def sentencepiece_bpe(
    metadata: Mapping[str, object], tokens: list[str], token_types: list[int], source: Path
) -> Tokenizer:
    if metadata.get("tokenizer.ggml.add_space_prefix", True) is not False:
        # llama.cpp prefixes a space unless told not to; Llama 2's tokenizer does that with a Metaspace
        # pre-tokenizer and a decoder that strips it again, which we have not verified.
        raise ModelLoadError(
            f"{source}: SentencePiece vocabularies that add a prefix space (tokenizer.ggml.add_space_prefix) "
            "are not supported; Gemma's, which add none, are"
        )
    vocab = _vocab(tokens, source)
    unknown_id = metadata.get("tokenizer.ggml.unknown_token_id")
    if not isinstance(unknown_id, int) or not 0 <= unknown_id < len(tokens):
        raise ModelLoadError(f"{source}: metadata 'tokenizer.ggml.unknown_token_id' is missing or out of range")
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=_merges_by_rank(vocab, token_types),
            unk_token=tokens[unknown_id],
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    tokenizer.normalizer = normalizers.Replace(" ", SPACE_MARK)
    tokenizer.decoder = decoders.Sequence([decoders.Replace(SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse()])
    # Control tokens (<bos>, <start_of_turn>) are special; user-defined ones ("\n\n", "<table>") are
    # matched whole in any text, as SentencePiece does, but are text: decoding keeps them. Both as
    # the vocabulary spells them ("▁▁"), which is how transformers adds them too.
    typed = list(zip(vocab, token_types))
    tokenizer.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token, kind in typed if kind == CONTROL_TOKEN_TYPE]
    )
    tokenizer.add_tokens(
        [AddedToken(token, special=False, normalized=False) for token, kind in typed if kind == USER_DEFINED_TOKEN_TYPE]
    )
    return tokenizer


def _vocab(tokens: list[str], source: Path) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for token_id, token in enumerate(tokens):
        # llama.cpp writes the pieces of two or more spaces with spaces; the model's tokenizer has "▁▁".
        if len(token) > 1 and token == " " * len(token):
            token = SPACE_MARK * len(token)
        if token in vocab:
            raise ModelLoadError(f"{source}: token {token!r} appears twice (ids {vocab[token]} and {token_id})")
        vocab[token] = token_id
    return vocab


def _merges_by_rank(vocab: dict[str, int], token_types: list[int]) -> list[tuple[str, str]]:
    """Every way to build a piece from two pieces, the pieces listed first merging first. Control and
    byte pieces are never built by merging: SentencePiece never forms them from text."""
    merges = []
    for token, token_type in zip(vocab, token_types):
        if token_type not in (NORMAL_TOKEN_TYPE, USER_DEFINED_TOKEN_TYPE):
            continue
        cuts = [(token[:cut], token[cut:]) for cut in range(len(token) - 1, 0, -1)]
        merges.extend((left, right) for left, right in cuts if left in vocab and right in vocab)
    return merges
