"""Token ids ↔ text for the benchmark, with the `tokenizers` package alone (no torch on this path
unless a packaged model name has to be resolved, which converts its GGUF file on first use)."""

from pathlib import Path

import numpy as np
import tokenizers


class TokenizerNotFound(ValueError):
    pass


class BenchTokenizer:
    def __init__(self, tokenizer: tokenizers.Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        added = set(tokenizer.get_added_tokens_decoder())
        # Added tokens are the control tokens (<|im_start|>, end of text, ...): a random prompt made of
        # them would change what the server does, not only what it reads.
        self.ordinary_ids: np.ndarray = np.array(
            [token_id for token_id in range(self.vocab_size) if token_id not in added], dtype=np.int64
        )

    @classmethod
    def load(cls, name_or_path: str) -> "BenchTokenizer":
        """A directory holding tokenizer.json, a tokenizer.json file, or one of our packaged model names."""
        path = Path(name_or_path).expanduser()
        if path.is_dir():
            path = path / "tokenizer.json"
        if path.is_file():
            return cls._from_file(path)
        return cls._from_file(_packaged_tokenizer_file(name_or_path))

    @classmethod
    def _from_file(cls, path: Path) -> "BenchTokenizer":
        try:
            return cls(tokenizers.Tokenizer.from_file(str(path)))
        except Exception as error:  # the tokenizers package raises plain Exception for a bad file
            raise TokenizerNotFound(f"{path}: not a tokenizer.json ({error})") from None

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: np.ndarray) -> str:
        return self._tokenizer.decode(token_ids.tolist(), skip_special_tokens=False)


def _packaged_tokenizer_file(name: str) -> Path:
    from workers.engine.weights.registry import find_packaged_model, packaged_model_names
    from workers.protocol.errors import ModelLoadError

    if find_packaged_model(name) is None:
        raise TokenizerNotFound(
            f"tokenizer {name!r}: neither a directory with tokenizer.json, a tokenizer.json file, nor a packaged "
            f"model ({', '.join(packaged_model_names())})"
        )
    # Imported here: resolving a packaged model loads torch (its GGUF file is converted on first use).
    from workers.engine.weights import resolve_model

    try:
        files = resolve_model(name, progress=False)
    except ModelLoadError as error:
        raise TokenizerNotFound(f"tokenizer {name!r}: {error}") from None
    if files.tokenizer_file is None:
        raise TokenizerNotFound(f"tokenizer {name!r}: {files.directory} has no tokenizer.json")
    return files.tokenizer_file
