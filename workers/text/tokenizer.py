"""Text ↔ token ids for one model, and its chat template.

Built on the `tokenizers` library with the model's `tokenizer.json` (byte-level BPE, or SentencePiece
BPE with byte fallback as Gemma's). User text never becomes a control token unless the caller asks for
it, and every token maps to the exact bytes it stands for, so that output can be decoded incrementally
(see `workers.text.detokenizer`).
"""

import json
import re
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Protocol

import tokenizers
from jinja2 import Template, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from workers.protocol.errors import InvalidRequestError, ModelLoadError

CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where newer transformers versions save the template
SPECIAL_TOKEN_ROLES = ("bos_token", "eos_token", "unk_token", "pad_token")
# SentencePiece BPE's decoder in a tokenizer.json (Gemma's): "▁" back to a space, byte tokens to bytes.
SENTENCEPIECE_DECODER = {
    "type": "Sequence",
    "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ],
}
SENTENCEPIECE_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character → byte: printable bytes stand for themselves, the
    others are shifted past U+0100 so that every byte has a visible character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {chr(byte): byte for byte in printable}
    unprintable = [byte for byte in range(256) if byte not in set(printable)]
    chars.update({chr(256 + offset): byte for offset, byte in enumerate(unprintable)})
    return chars


BYTE_LEVEL_CHARS = _byte_level_chars()


class TokenizerFiles(Protocol):
    """What a tokenizer is read from: a model directory's files (workers.engine.weights.ModelFiles)."""

    directory: Path
    tokenizer_file: Path | None
    tokenizer_config: dict
    generation_config: dict


class Tokenizer:
    def __init__(
        self,
        *,
        tokenizer_json: str,
        tokenizer_config: Mapping[str, object],
        generation_config: Mapping[str, object],
        chat_template: str | None,
        source: Path,
    ) -> None:
        spelled_bytes = _token_spelling(json.loads(tokenizer_json).get("decoder") or {}, source)
        # encode_special_tokens is state on the object, so one object per setting keeps encode thread-safe.
        self._parses_specials = tokenizers.Tokenizer.from_str(tokenizer_json)
        self._specials_as_text = tokenizers.Tokenizer.from_str(tokenizer_json)
        self._specials_as_text.encode_special_tokens = True

        self.vocab_size: int = self._parses_specials.get_vocab_size(with_added_tokens=True)
        self._token_bytes = _token_bytes_table(self._parses_specials, spelled_bytes)
        self.special_token_ids: frozenset[int] = frozenset(
            token_id for token_id, added in self._parses_specials.get_added_tokens_decoder().items() if added.special
        )
        self._special_tokens = {
            role: text for role in SPECIAL_TOKEN_ROLES if (text := _token_text(tokenizer_config.get(role))) is not None
        }
        self.bos_token_id: int | None = self._special_token_id("bos_token", generation_config.get("bos_token_id"))
        self.eos_token_ids: frozenset[int] = frozenset(
            _ids(generation_config.get("eos_token_id")) | _ids(self._special_token_id("eos_token", None))
        )
        self._add_bos = tokenizer_config.get("add_bos_token") is True and self.bos_token_id is not None
        self.chat_template: str | None = chat_template
        self._compiled_template = _compile_chat_template(chat_template) if chat_template else None

    @classmethod
    def from_model_files(cls, files: "TokenizerFiles") -> "Tokenizer":
        if files.tokenizer_file is None:
            raise ModelLoadError(f"{files.directory}: no tokenizer.json")
        try:
            tokenizer_json = files.tokenizer_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise ModelLoadError(f"{files.tokenizer_file}: unreadable: {error}") from error
        return cls(
            tokenizer_json=tokenizer_json,
            tokenizer_config=files.tokenizer_config,
            generation_config=files.generation_config,
            chat_template=_find_chat_template(files),
            source=files.tokenizer_file,
        )

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        """Without allow_special, text such as "<|im_start|>" encodes as ordinary tokens."""
        encoder = self._parses_specials if allow_special else self._specials_as_text
        try:
            # encode_batch, not encode: only it releases the GIL while it works (seconds for a long
            # text), so other threads, the gateway's event loop among them, run meanwhile.
            ids = encoder.encode_batch([text], add_special_tokens=False)[0].ids
        except TypeError:  # what `tokenizers` raises for a str that is not Unicode text (a lone surrogate)
            raise InvalidRequestError("the text is not valid Unicode (it has a lone surrogate)") from None
        return [self.bos_token_id, *ids] if self._add_bos else ids

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._parses_specials.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def same_vocabulary(self, other: "Tokenizer") -> bool:
        """Whether `other` spells every token id as this one does, with the same special tokens: a
        model of either tokenizer reads the other's ids as the same text."""
        return self._token_bytes == other._token_bytes and self.special_token_ids == other.special_token_ids

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes this token stands for; b"" for an id the vocabulary does not assign, which
        decode() drops too."""
        if token_id < 0:
            raise ValueError(f"token id {token_id} is negative")
        return self._token_bytes[token_id] if token_id < len(self._token_bytes) else b""

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True) -> str:
        if self._compiled_template is None:
            raise InvalidRequestError("this model has no chat template")
        # Like transformers: a None field counts as absent, which templates handle better than "None".
        present = [{key: value for key, value in message.items() if value is not None} for message in messages]
        try:
            return self._compiled_template.render(
                messages=present,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self._special_tokens,
            )
        except TemplateError as error:
            raise InvalidRequestError(f"the chat template rejected these messages: {error}") from error

    def _special_token_id(self, role: str, fallback: object) -> int | None:
        text = self._special_tokens.get(role)
        token_id = self._parses_specials.token_to_id(text) if text is not None else None
        if token_id is not None:
            return token_id
        return fallback if isinstance(fallback, int) else None


def _token_spelling(decoder: Mapping[str, object], source: Path) -> Callable[[str], bytes]:
    """How a token's text spells its bytes, by the decoder of the tokenizer: byte-level BPE's, or
    SentencePiece's ("▁" for a space, <0x0A> for a byte, as Gemma's tokenizer.json decodes)."""
    if decoder.get("type") == "ByteLevel":
        return _byte_level_bytes
    if decoder == SENTENCEPIECE_DECODER:
        return _sentencepiece_bytes
    raise ModelLoadError(
        f"{source}: decoder {decoder.get('type')!r} is not supported (byte-level BPE, or SentencePiece's "
        "with byte fallback)"
    )


def _token_bytes_table(backend: tokenizers.Tokenizer, spelled_bytes: Callable[[str], bytes]) -> tuple[bytes, ...]:
    vocab = backend.get_vocab(with_added_tokens=True)
    table = [b""] * (max(vocab.values(), default=-1) + 1)
    for token, token_id in vocab.items():
        table[token_id] = spelled_bytes(token)
    return tuple(table)


def _sentencepiece_bytes(token: str) -> bytes:
    byte = SENTENCEPIECE_BYTE_TOKEN.fullmatch(token)
    return bytes([int(byte[1], 16)]) if byte else token.replace("▁", " ").encode("utf-8")


def _byte_level_bytes(token: str) -> bytes:
    # Same rule as the tokenizers ByteLevel decoder: a token spelled wholly in the byte alphabet
    # stands for those bytes; any other token (an added token with other characters) for its UTF-8.
    try:
        return bytes(BYTE_LEVEL_CHARS[char] for char in token)
    except KeyError:
        return token.encode("utf-8")


def _token_text(value: object) -> str | None:
    # tokenizer_config writes a special token either as a string or as a serialized AddedToken.
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: object) -> set[int]:
    """generation_config's eos_token_id is an int, a list of ints, or absent."""
    values = value if isinstance(value, list) else [value]
    return {item for item in values if isinstance(item, int)}


def _compile_chat_template(chat_template: str) -> Template:
    # The environment transformers' apply_chat_template renders in, so templates render identically.
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    return environment.from_string(chat_template)


def _tojson(
    value: object,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers replaces jinja's tojson, which HTML-escapes; templates rely on plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _find_chat_template(files: "TokenizerFiles") -> str | None:
    template = files.tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        template = next((entry.get("template") for entry in template if entry.get("name") == "default"), None)
    if isinstance(template, str):
        return template
    template_file = files.directory / CHAT_TEMPLATE_FILE
    return template_file.read_text(encoding="utf-8") if template_file.is_file() else None
