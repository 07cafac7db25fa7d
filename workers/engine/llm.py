"""The offline API: `LLM(model).generate(prompts, SamplingParams(...))`, and for a vision-language
model `generate(prompts, params, images=[[image, ...], ...])`."""

import itertools
from collections.abc import Sequence
from typing import Any

import msgspec
import torch
from PIL import Image

from workers.args import EngineArgs
from workers.engine.dtypes import dtype_name
from workers.engine.factory import build_engine
from workers.engine.image_inputs import ImageEncoder, image_settings
from workers.engine.model_loader import ModelSource
from workers.engine.models.idefics3 import Idefics3ForConditionalGeneration
from workers.engine.outputs import CompletionOutput, RequestOutput
from workers.protocol.engine_request import EngineRequest
from workers.protocol.errors import InvalidRequestError
from workers.protocol.images import ImageEmbeddings
from workers.protocol.messages import CacheHint
from workers.protocol.sampling_params import SamplingParams
from workers.text.idefics3_images import ImageSettings, expand_image_placeholders

Prompt = str | list[int]


class LLM:
    """Generate from many prompts at once with continuous batching.

    `model` is a packaged model name ("smollm2-135m-instruct"), a Hugging Face directory, or a
    config (dict or JSON path) for a random-weight model built from `seed`. String prompts are
    tokenized with special tokens recognized, since the offline caller writes the whole prompt;
    the serving path (recipe) never lets user text become a special token.

    `kv_store` is a directory for the global KV block store (index: "memory" or a redis:// URL):
    prompts reuse the blocks stored there, and what this engine computes is stored. Call `close()`
    to finish writing before the process exits.

    A vision-language model (Idefics3 / SmolVLM) takes images with its prompts: `images[i]` are
    prompt i's Pillow images, in the order of its placeholders. A text prompt holds one "<image>" per
    image, expanded here to the image's layout; a token-id prompt holds the expanded layout already
    (the model's image token once per embedding). The images are preprocessed
    (workers.text.idefics3_images, with `image_settings`, by default the model directory's
    preprocessor_config.json) and encoded by the model's vision encoder in-process.
    """

    def __init__(
        self,
        model: ModelSource,
        *,
        dtype: str | torch.dtype | None = None,
        step_budget_s: float | None = None,
        image_settings: ImageSettings | None = None,
        **settings: Any,
    ) -> None:
        """`settings` are EngineArgs fields (workers.args: seed, device, attention_backend, num_pages,
        kv_cache_bytes, max_num_seqs, kv_store, cost_model, ...); `dtype` may also be a torch dtype,
        and `step_budget_s` stands for step_budget_ms in seconds."""
        if step_budget_s is not None:
            settings["step_budget_ms"] = step_budget_s * 1000
        args = EngineArgs(model=model, dtype=dtype_name(dtype) if dtype is not None else None, **settings)
        self.engine = build_engine(args)
        self.tokenizer = self.engine.info.tokenizer
        self._ids = itertools.count()
        self._model_source = model
        self._image_settings = image_settings
        self._image_encoder: ImageEncoder | None = None

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        cache_namespace: str = "",
        cache_hints: Sequence[CacheHint] = (),
        images: Sequence[Sequence[Image.Image]] | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. Invalid input raises before any work starts.
        `cache_hints` apply to every prompt (workers.protocol.messages.CacheHint); `images`, one
        sequence per prompt, are each prompt's images (see the class docstring)."""
        prompt_list = _as_prompt_list(prompts)
        if images is not None and len(images) != len(prompt_list):
            raise InvalidRequestError(f"images: {len(images)} image lists for {len(prompt_list)} prompts")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise InvalidRequestError(f"{len(params_list)} sampling params for {len(prompt_list)} prompts")

        results: list[RequestOutput] = []
        slots: dict[str, CompletionOutput] = {}
        try:
            for index, (prompt, params) in enumerate(zip(prompt_list, params_list)):
                token_ids, embeddings = self._prompt_inputs(prompt, images[index] if images is not None else ())
                result = RequestOutput(request_id=str(next(self._ids)), prompt_token_ids=token_ids, outputs=[])
                for index in range(params.n):
                    sub_id = f"{result.request_id}-{index}"
                    seed = None if params.seed is None else params.seed + index
                    self.engine.add_request(
                        EngineRequest(
                            request_id=sub_id,
                            prompt_token_ids=token_ids,
                            params=msgspec.structs.replace(params, n=1, seed=seed),
                            cache_namespace=cache_namespace,
                            cache_hints=tuple(cache_hints),
                            images=embeddings,
                        )
                    )
                    completion = CompletionOutput(index=index, logprobs=[] if params.logprobs is not None else None)
                    if self.tokenizer is not None:
                        completion.text = ""
                    result.outputs.append(completion)
                    slots[sub_id] = completion
                results.append(result)
        except Exception:
            for sub_id in slots:
                self.engine.abort_request(sub_id)
            raise

        by_id = {r.request_id: r for r in results}
        while self.engine.has_unfinished():
            for delta in self.engine.step():
                completion = slots[delta.request_id]
                completion.token_ids.extend(delta.token_ids)
                if delta.text is not None:
                    completion.text += delta.text
                if completion.logprobs is not None:
                    completion.logprobs.extend(delta.logprobs)
                if delta.finished:
                    completion.finish_reason = delta.finish_reason
                    completion.stop_reason = delta.stop_reason
                result = by_id[delta.request_id.rsplit("-", 1)[0]]
                result.num_cached_tokens = delta.num_cached_tokens
                if completion.index == 0:
                    result.num_stored_tokens = delta.num_stored_tokens
                    result.stored_tokens_by_hint = delta.stored_tokens_by_hint
        return results

    def close(self) -> None:
        self.engine.close()

    def _prompt_inputs(
        self, prompt: Prompt, images: Sequence[Image.Image]
    ) -> tuple[list[int], tuple[ImageEmbeddings, ...]]:
        """The prompt's token ids, its placeholders expanded, and its images' embeddings."""
        if not images:
            return self._tokenize(prompt), ()
        encoder = self._encoder()
        layouts, embeddings = zip(*(encoder.encode(image) for image in images), strict=True)
        if isinstance(prompt, str):
            try:
                prompt = expand_image_placeholders(prompt, list(layouts), encoder.settings)
            except ValueError as error:
                raise InvalidRequestError(f"images: {error}") from None
        return self._tokenize(prompt), tuple(embeddings)

    def _encoder(self) -> ImageEncoder:
        if self._image_encoder is None:
            model = getattr(getattr(self.engine, "runner", None), "model", None)
            if not isinstance(model, Idefics3ForConditionalGeneration):
                raise InvalidRequestError("images: this model takes no images (it is not a vision-language model)")
            settings = self._image_settings or image_settings(model, self._model_source)
            self._image_encoder = ImageEncoder(model, settings)
        return self._image_encoder

    def _tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("text prompts need a tokenizer; pass token ids or load one with tokenizer=")
            return self.tokenizer.encode(prompt, allow_special=True)
        return list(prompt)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) for p in prompts):
        return [prompts]  # a single prompt given as token ids
    for prompt in prompts:
        if not isinstance(prompt, str | list | tuple):
            raise InvalidRequestError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
    return [p if isinstance(p, str) else list(p) for p in prompts]
