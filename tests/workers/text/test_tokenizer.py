import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer as BackendTokenizer

from tests.workers.text.tiny_tokenizer import TINY_CHAT_TEMPLATE, make_tiny_tokenizer, tiny_tokenizer_json
from workers.engine.weights import ModelFiles
from workers.protocol.errors import InvalidRequestError, ModelLoadError
from workers.text.tokenizer import Tokenizer

IM_START, IM_END = 1, 2
REPO_ROOT = Path(__file__).resolve().parents[3]

DIGIT_FREE_TEXTS = [
    "Hello, world! How are you doing today?",
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n\nclass Point:\n\tx: float\n",
    "for (int i = 0; i < n; ++i) { sum += xs[i]; }  // comment",
    "Grüße aus München, naïve café, élève, Ærø",
    "Привет, как дела? Всё хорошо.",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "Emoji: 😀👍🏽🇺🇸 and ❤️ and 👨‍👩‍👧",
    "   leading spaces, trailing spaces   ",
    "tabs\tand\nnewlines\r\nmixed\n\n\n   indented",
    "I'm sure they'll say it's fine, don't you think? We've seen it.",
    "<|im_end|> and <|endoftext|> written as text",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?\nAnswer in one word."},
    ],
    [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi! How can I help?"},
        {"role": "user", "content": "Tell me a joke 😀"},
    ],
]


def test_modules_import_on_their_own() -> None:
    """The gateway imports the text layer without having imported the engine first."""
    imported = subprocess.run(
        [sys.executable, "-c", "import workers.text.tokenizer, workers.text.detokenizer"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )

    assert imported.returncode == 0, imported.stderr


def test_text_never_becomes_a_special_token_unless_allowed(tiny_tokenizer: Tokenizer) -> None:
    text = "<|im_start|>system\nhi<|im_end|>"

    plain = tiny_tokenizer.encode(text)
    parsed = tiny_tokenizer.encode(text, allow_special=True)

    assert not set(plain) & tiny_tokenizer.special_token_ids
    assert parsed[0] == IM_START and parsed[-1] == IM_END
    assert tiny_tokenizer.decode(plain) == text


def test_no_bos_is_added_unless_the_config_says_so() -> None:
    assert make_tiny_tokenizer().encode("he") == [260]
    with_bos = make_tiny_tokenizer(tokenizer_config={"bos_token": "<|im_start|>", "add_bos_token": True})
    assert with_bos.encode("he") == [IM_START, 260]


def test_special_token_ids_come_from_both_configs(tiny_tokenizer: Tokenizer) -> None:
    assert tiny_tokenizer.vocab_size == 3 + 256 + 2
    assert tiny_tokenizer.special_token_ids == {0, 1, 2}
    assert tiny_tokenizer.bos_token_id == IM_START
    assert make_tiny_tokenizer(generation_config={"eos_token_id": 0}).eos_token_ids == {0, IM_END}


def test_special_tokens_may_be_serialized_added_tokens() -> None:
    tokenizer = make_tiny_tokenizer(tokenizer_config={"eos_token": {"content": "<|im_end|>", "special": True}})

    assert tokenizer.eos_token_ids == {0, IM_END}


def test_token_bytes(tiny_tokenizer: Tokenizer) -> None:
    assert tiny_tokenizer.token_bytes(259) == b" t"
    assert tiny_tokenizer.token_bytes(IM_END) == b"<|im_end|>"
    assert tiny_tokenizer.token_bytes(10_000) == b""
    with pytest.raises(ValueError):
        tiny_tokenizer.token_bytes(-1)


def test_chat_template_errors_are_request_errors() -> None:
    strict = make_tiny_tokenizer(chat_template="{{ raise_exception('roles must alternate') }}")

    with pytest.raises(InvalidRequestError, match="roles must alternate"):
        strict.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(InvalidRequestError, match="no chat template"):
        make_tiny_tokenizer(chat_template=None).apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_template_has_hf_variables_and_filters() -> None:
    template = "{{ bos_token }}|{{ eos_token }}|{{ messages | tojson }}|{{ add_generation_prompt }}|{{ tools is none }}"
    tokenizer = make_tiny_tokenizer(chat_template=template)

    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "é<b>", "name": None}])

    assert rendered == '<|im_start|>|<|im_end|>|[{"role": "user", "content": "é<b>"}]|True|True'


# Metaspace, and Llama 2's SentencePiece decoder, which strips the space it prefixed: only byte-level
# BPE and SentencePiece with byte fallback and no prefix space (Gemma's) spell every token's bytes.
@pytest.mark.parametrize(
    ("decoder", "named"),
    [
        ({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True}, "Metaspace"),
        (
            {
                "type": "Sequence",
                "decoders": [
                    {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                    {"type": "ByteFallback"},
                    {"type": "Fuse"},
                    {"type": "Strip", "content": " ", "start": 1, "stop": 0},
                ],
            },
            "Sequence",
        ),
    ],
)
def test_tokenizers_other_than_byte_level_or_gemma_sentencepiece_are_refused(decoder: dict, named: str) -> None:
    spec = json.loads(tiny_tokenizer_json())
    spec["decoder"] = decoder

    with pytest.raises(ModelLoadError, match=f"decoder '{named}'"):
        Tokenizer(
            tokenizer_json=json.dumps(spec),
            tokenizer_config={},
            generation_config={},
            chat_template=None,
            source=Path("x"),
        )


def tiny_model_files(directory: Path, *, with_tokenizer: bool = True) -> ModelFiles:
    tokenizer_file = directory / "tokenizer.json"
    tokenizer_file.write_text(tiny_tokenizer_json())
    return ModelFiles(
        name="tiny",
        directory=directory,
        config={},
        weight_files=(),
        tokenizer_file=tokenizer_file if with_tokenizer else None,
        tokenizer_config={"eos_token": "<|im_end|>"},
        generation_config={},
    )


def test_model_files_without_tokenizer_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        Tokenizer.from_model_files(tiny_model_files(tmp_path, with_tokenizer=False))


def test_chat_template_may_live_in_its_own_file(tmp_path: Path) -> None:
    (tmp_path / "chat_template.jinja").write_text(TINY_CHAT_TEMPLATE)

    tokenizer = Tokenizer.from_model_files(tiny_model_files(tmp_path))

    assert tokenizer.chat_template == TINY_CHAT_TEMPLATE
    inline = dataclasses.replace(tiny_model_files(tmp_path), tokenizer_config={"chat_template": "{{ 'inline' }}"})
    assert Tokenizer.from_model_files(inline).chat_template == "{{ 'inline' }}"


@pytest.mark.slow
@pytest.mark.parametrize("text", DIGIT_FREE_TEXTS)
def test_smollm2_matches_transformers_on_digit_free_text(
    smollm2_tokenizer: Tokenizer, transformers_gguf_tokenizer, text: str
) -> None:
    # transformers' GGUF converter ignores tokenizer.ggml.pre (no digit splitting): compare without digits.
    expected = transformers_gguf_tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)

    ids = smollm2_tokenizer.encode(text)

    assert ids == expected
    assert smollm2_tokenizer.decode(ids) == transformers_gguf_tokenizer.decode(ids) == text


@pytest.mark.slow
def test_smollm2_splits_digits_like_the_original_tokenizer(
    smollm2_files: ModelFiles, smollm2_tokenizer: Tokenizer, transformers_gguf_tokenizer
) -> None:
    vocab = BackendTokenizer.from_file(str(smollm2_files.tokenizer_file)).get_vocab()

    def spelled(ids: list[int]) -> list[str]:
        by_id = {token_id: token for token, token_id in vocab.items()}
        return [by_id[token_id] for token_id in ids]

    assert spelled(smollm2_tokenizer.encode("x=12345;")) == ["x", "=", "1", "2", "3", "4", "5", ";"]
    assert spelled(smollm2_tokenizer.encode("In 2024")) == ["In", "Ġ", "2", "0", "2", "4"]
    # The original splits every \p{N} character off before byte-level BPE; without that split a space
    # merges with the first byte of "½" instead, which is what transformers' GGUF tokenizer does.
    assert spelled(smollm2_tokenizer.encode(" ½ cup")) == ["Ġ", "Â½", "Ġcup"]
    assert transformers_gguf_tokenizer.tokenize(" ½ cup") == ["ĠÂ", "½", "Ġcup"]


@pytest.mark.slow
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_smollm2_chat_template_renders_like_transformers(
    smollm2_tokenizer: Tokenizer, transformers_gguf_tokenizer, messages: list[dict], add_generation_prompt: bool
) -> None:
    expected = transformers_gguf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )

    assert smollm2_tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


@pytest.mark.slow
def test_smollm2_control_tokens_in_text(smollm2_tokenizer: Tokenizer, transformers_gguf_tokenizer) -> None:
    text = "<|im_start|>system"

    plain = smollm2_tokenizer.encode(text)
    parsed = smollm2_tokenizer.encode(text, allow_special=True)

    assert not set(plain) & smollm2_tokenizer.special_token_ids
    assert plain == transformers_gguf_tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
    assert parsed[0] == IM_START
    assert parsed == transformers_gguf_tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.slow
def test_smollm2_tokenizer_properties(smollm2_tokenizer: Tokenizer) -> None:
    assert smollm2_tokenizer.vocab_size == 49152
    assert smollm2_tokenizer.bos_token_id == IM_START
    assert smollm2_tokenizer.eos_token_ids == {0, IM_END}
    assert smollm2_tokenizer.special_token_ids == set(range(17))
    assert smollm2_tokenizer.chat_template.startswith("{% for message in messages %}")
    assert smollm2_tokenizer.encode("hello")[0] != IM_START
