from pathlib import Path

import pytest
import tokenizers
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from bench.serve.tokenizer import BenchTokenizer

SPECIALS = ("<s>", "</s>")
WORDS = tuple(f"w{i}" for i in range(50))


def word_level_tokenizer() -> tokenizers.Tokenizer:
    """A real tokenizer, small enough to read: ids 0-1 are special, then w0..w49, then [UNK]."""
    vocab = {word: token_id for token_id, word in enumerate((*SPECIALS, *WORDS, "[UNK]"))}
    tokenizer = tokenizers.Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.add_special_tokens(list(SPECIALS))
    return tokenizer


@pytest.fixture
def word_tokenizer() -> BenchTokenizer:
    return BenchTokenizer(word_level_tokenizer())


@pytest.fixture
def tokenizer_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "tokenizer"
    directory.mkdir()
    word_level_tokenizer().save(str(directory / "tokenizer.json"))
    return directory
