"""Drafts from a smaller model that shares the target's tokenizer (--spec-method draft,
--spec-draft-model), run by an engine of its own in the same process and on the same device.

A proposal is one request to the draft engine: its prompt the request's tokens so far, greedy, up to
k new tokens, each with its logprob. The draft engine's prefix cache keeps a request's history from
one proposal to the next, so a proposal computes only the tokens since the previous one (and the
last partial page) plus its k decode steps. The drafted tokens are the draft model's argmax: a point
mass, as verification treats every draft; the probability its softmax gave each one is the draft's
confidence.

The draft engine holds KV for the target's batch at the target's context length (`num_pages`), so it
never preempts; its weights and KV come out of the device memory the target leaves. The builder
(workers.engine.builder) makes it and checks that it reads the target's token ids as the same text.
"""

import itertools
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from workers.args import EngineArgs
from workers.engine.outputs import RequestDelta
from workers.engine.spec.drafter import NO_DRAFT, Draft, DraftAsk
from workers.protocol.engine_request import EngineRequest
from workers.protocol.errors import ModelLoadError
from workers.protocol.sampling_params import SamplingParams
from workers.text.tokenizer import Tokenizer

DRAFT_SETTING = "spec_draft_model"
ModelSource = str | os.PathLike | dict[str, Any]


class DraftEngine(Protocol):
    """What the drafter needs of the draft model's engine (an LLMEngine: workers.engine.builder
    builds it)."""

    def add_request(self, request: EngineRequest) -> None: ...

    def step(self) -> list[RequestDelta]: ...

    def has_unfinished(self) -> bool: ...


def draft_engine_args(draft_model: ModelSource | None, target: EngineArgs, max_model_len: int) -> EngineArgs:
    """The draft model's engine settings for a target engine of `target` serving `max_model_len`
    tokens; ModelLoadError naming spec_draft_model when there is no draft model."""
    if draft_model is None:
        raise ModelLoadError(f"spec_method 'draft' needs {DRAFT_SETTING}: the draft model to propose tokens")
    pages_per_request = -(-max_model_len // target.page_size)
    return EngineArgs(
        model=draft_model,
        # A config (random weights) has no tokenizer of its own: it drafts with the target's.
        tokenizer=_tokenizer_source(target) if _is_config(draft_model) else None,
        device=target.device,
        dtype=target.dtype,
        seed=target.seed,
        attention_backend=target.attention_backend,
        max_model_len=max_model_len,
        max_num_seqs=target.max_num_seqs,
        page_size=target.page_size,
        num_pages=target.max_num_seqs * pages_per_request + 1,
        enforce_eager=target.enforce_eager,
    )


def check_draft_model(
    name: str,
    vocab_size: int,
    tokenizer: Tokenizer | None,
    *,
    target_vocab_size: int,
    target_tokenizer: Tokenizer | None,
) -> None:
    """ModelLoadError naming spec_draft_model unless draft model `name` reads the target's token ids as
    the same text."""
    if vocab_size != target_vocab_size:
        raise ModelLoadError(
            f"{DRAFT_SETTING} {name!r} reads {vocab_size} token ids, the target {target_vocab_size}: "
            "a draft model must share the target's tokenizer"
        )
    if tokenizer is None or target_tokenizer is None:
        if tokenizer is not target_tokenizer:
            raise ModelLoadError(
                f"{DRAFT_SETTING} {name!r}: one of the draft and target models has a tokenizer and the other "
                "none, so they cannot be checked to share one"
            )
    elif not target_tokenizer.same_vocabulary(tokenizer):
        raise ModelLoadError(
            f"{DRAFT_SETTING} {name!r} has another tokenizer than the target: its token ids spell other "
            "text, so its drafts would never be accepted"
        )


class DraftModelDrafter:
    def __init__(self, engine: DraftEngine) -> None:
        self.engine = engine
        self._ids = itertools.count()

    def propose_all(self, asks: Sequence[DraftAsk]) -> list[Draft]:
        """One draft engine request per ask that may draft, run together as one batch."""
        names = {}
        for ask in asks:
            if ask.max_tokens <= 0:
                continue
            request_id = f"draft-{next(self._ids)}"
            names[request_id] = len(names)
            self.engine.add_request(
                EngineRequest(
                    request_id=request_id,
                    prompt_token_ids=[*ask.prompt_token_ids, *ask.output_token_ids],
                    params=SamplingParams(temperature=0.0, max_tokens=ask.max_tokens, ignore_eos=True, logprobs=0),
                )
            )
        token_ids: list[list[int]] = [[] for _ in names]
        logprobs: list[list[float]] = [[] for _ in names]
        while self.engine.has_unfinished():
            for delta in self.engine.step():
                index = names[delta.request_id]
                token_ids[index].extend(delta.token_ids)
                logprobs[index].extend(entry.logprob for entry in delta.logprobs)
        drafts = iter([Draft(tokens, [math.exp(lp) for lp in lps]) for tokens, lps in zip(token_ids, logprobs)])
        return [next(drafts) if ask.max_tokens > 0 else NO_DRAFT for ask in asks]


def _is_config(model: ModelSource) -> bool:
    """Whether `model` is a config (a dict or a JSON file: random weights, no tokenizer of its own)."""
    return isinstance(model, dict) or Path(model).is_file()


def _tokenizer_source(target: EngineArgs) -> ModelSource | None:
    """Where the target's tokenizer comes from: its tokenizer setting, else its model (a name or a
    directory; a config has none)."""
    if target.tokenizer is not None:
        return target.tokenizer
    return None if _is_config(target.model) else target.model
