"""The offline API: `LLM(model).generate(prompts, SamplingParams(...))`."""

import itertools
from collections.abc import Sequence
from typing import Any

import msgspec
import torch

from workers.args import EngineArgs
from workers.engine.dtypes import dtype_name
from workers.engine.factory import build_engine
from workers.engine.model_loader import ModelSource
from workers.engine.outputs import CompletionOutput, RequestOutput
from workers.protocol.engine_request import EngineRequest
from workers.protocol.errors import InvalidRequestError
from workers.protocol.messages import CacheHint
from workers.protocol.sampling_params import SamplingParams

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
    """

    def __init__(
        self,
        model: ModelSource,
        *,
        dtype: str | torch.dtype | None = None,
        step_budget_s: float | None = None,
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

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        cache_namespace: str = "",
        cache_hints: Sequence[CacheHint] = (),
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. Invalid input raises before any work starts.
        `cache_hints` apply to every prompt (workers.protocol.messages.CacheHint)."""
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise InvalidRequestError(f"{len(params_list)} sampling params for {len(prompt_list)} prompts")

        results: list[RequestOutput] = []
        slots: dict[str, CompletionOutput] = {}
        try:
            for prompt, params in zip(prompt_list, params_list):
                token_ids = self._tokenize(prompt)
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
