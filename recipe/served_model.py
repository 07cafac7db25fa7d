"""A model as the API sees it: its name, tokenizers, prompt format, context window, and for a
vision-language model how images go into its prompts."""

from dataclasses import dataclass
from typing import Literal, Protocol

import deepseek_recipe

from workers.protocol.errors import ModelLoadError
from workers.text.idefics3_images import IMAGE_TOKEN, image_tag_tokens
from workers.text.tokenizer import Tokenizer, TokenizerFiles
from workers.text.vision_prompt import VisionPrompt, read_vision_prompt

PromptFamily = Literal["chatml", "deepseek_v41"]

CHATML_MARKER = "<|im_start|>"
DEEPSEEK_V41_MARKER = deepseek_recipe.SpecialToken.Assistant.default_str()


class ServedModelFiles(TokenizerFiles, Protocol):
    """A served model's files (workers.engine.weights.ModelFiles): its tokenizer's and its config,
    under its name."""

    name: str
    config: dict


@dataclass(frozen=True)
class ServedModel:
    name: str  # the name clients pass as `model`, e.g. "smollm2-135m-instruct"
    tokenizer: Tokenizer
    family: PromptFamily  # how conversations become prompts (see recipe.prompt_encoding)
    max_model_len: int  # context window: prompt plus output tokens
    # The same tokenizer.json loaded by deepseek-recipe: its stream processor decodes token chunks
    # (logprobs, DeepSeek models) and its DeepSeek prompt encoding encodes with it.
    codec_tokenizer: deepseek_recipe.Tokenizer
    # How images become prompt tokens (recipe.image_prompts); None: the model takes no images.
    vision: VisionPrompt | None = None

    @classmethod
    def from_model_files(cls, files: ServedModelFiles, max_model_len: int) -> "ServedModel":
        tokenizer = Tokenizer.from_model_files(files)
        assert files.tokenizer_file is not None  # Tokenizer.from_model_files raised otherwise
        family = prompt_family(tokenizer)
        vision = read_vision_prompt(files.directory, files.config)
        if vision is not None:
            _check_image_tokens(vision, tokenizer, family)
        return cls(
            name=files.name,
            tokenizer=tokenizer,
            family=family,
            max_model_len=max_model_len,
            codec_tokenizer=deepseek_recipe.Tokenizer.from_file(str(files.tokenizer_file)),
            vision=vision,
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


def _check_image_tokens(vision: VisionPrompt, tokenizer: Tokenizer, family: PromptFamily) -> None:
    """Every image tag is one special token, so that the recipe can write it as a control token and
    user text, encoded with special tokens off, can never spell it; the image token is `<image>`."""
    if family != "chatml":
        raise ModelLoadError(f"images are taken in ChatML prompts only; this model's prompt format is {family}")
    special = {
        tokenizer.token_bytes(token_id).decode("utf-8", "replace"): token_id for token_id in tokenizer.special_token_ids
    }
    missing = [tag for tag in image_tag_tokens(vision.settings) if tag not in special]
    if missing:
        raise ModelLoadError(f"the tokenizer lacks the image tags {', '.join(missing)} as special tokens")
    if special[IMAGE_TOKEN] != vision.image_token_id:
        raise ModelLoadError(
            f"config.json's image_token_id ({vision.image_token_id}) is not the tokenizer's "
            f"{IMAGE_TOKEN} ({special[IMAGE_TOKEN]})"
        )
