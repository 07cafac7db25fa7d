"""A model as the API sees it: its name, tokenizers, prompt format and context window."""

from dataclasses import dataclass
from typing import Literal, Protocol

import deepseek_recipe

from workers.protocol.errors import ModelLoadError
from workers.text.tokenizer import Tokenizer, TokenizerFiles

PromptFamily = Literal["chatml", "deepseek_v41"]

CHATML_MARKER = "<|im_start|>"
DEEPSEEK_V41_MARKER = deepseek_recipe.SpecialToken.Assistant.default_str()


class ServedModelFiles(TokenizerFiles, Protocol):
    """A served model's files (workers.engine.weights.ModelFiles): its tokenizer's, under its name."""

    name: str


@dataclass(frozen=True)
class ServedModel:
    name: str  # the name clients pass as `model`, e.g. "smollm2-135m-instruct"
    tokenizer: Tokenizer
    family: PromptFamily  # how conversations become prompts (see recipe.prompt_encoding)
    max_model_len: int  # context window: prompt plus output tokens
    # The same tokenizer.json loaded by deepseek-recipe: its stream processor decodes token chunks
    # (logprobs, DeepSeek models) and its DeepSeek prompt encoding encodes with it.
    codec_tokenizer: deepseek_recipe.Tokenizer

    @classmethod
    def from_model_files(cls, files: ServedModelFiles, max_model_len: int) -> "ServedModel":
        tokenizer = Tokenizer.from_model_files(files)
        assert files.tokenizer_file is not None  # Tokenizer.from_model_files raised otherwise
        return cls(
            name=files.name,
            tokenizer=tokenizer,
            family=prompt_family(tokenizer),
            max_model_len=max_model_len,
            codec_tokenizer=deepseek_recipe.Tokenizer.from_file(str(files.tokenizer_file)),
        )


def prompt_family(tokenizer: Tokenizer) -> PromptFamily:
    """From the chat template, or, for models shipped without one, from the special tokens."""
    special_spellings = {
        tokenizer.token_bytes(token_id).decode("utf-8", "replace") for token_id in tokenizer.special_token_ids
    }
    for markers in (tokenizer.chat_template or "", special_spellings):
        if DEEPSEEK_V41_MARKER in markers:
            return "deepseek_v41"
        if CHATML_MARKER in markers:
            return "chatml"
    raise ModelLoadError("cannot tell the model's prompt format: neither a ChatML nor a DeepSeek V4.1 chat template")
