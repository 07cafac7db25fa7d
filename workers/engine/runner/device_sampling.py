"""Sampling on the device with no host synchronisation: the host Sampler's whole pipeline (logit
bias, repetition / frequency / presence penalties, the output constraint's mask, greedy argmax or
temperature, top-k, top-p, min-p and the exponential race over counter-based noise, top-k logprobs
of the raw logits) as row-local ops whose parameters are tensors, so one launch sequence serves rows
with different settings and can be captured in a CUDA graph.

Modes, the least a step needs: "greedy" (argmax of the raw logits), "sample" (the sampling chain),
"extras" (bias, penalties and masks first), "logprobs" (extras, and the sampled tokens' logprobs).
The rows' history lives on the device (SamplingExtras): token counts and seen-token flags updated by
every step from the ids it samples, dense logit-bias rows, the constraint masks of the step. Neutral
settings are exact no-ops (x + 0, x / 1, x - 0·n), so a row gets bitwise what the host Sampler gives
it whatever else is batched (greedy rows; seeded rows draw the same counter noise).
"""

from dataclasses import dataclass

import torch

from kernels import sampling
from workers.protocol.logprobs import TokenLogprobs
from workers.protocol.sampling_params import MAX_LOGPROBS, SamplingParams

MODES = ("greedy", "sample", "extras", "logprobs")


@dataclass(frozen=True, slots=True)
class SamplingTensors:
    """Per sampling sequence, its parameters on the device."""

    greedy: torch.Tensor  # [samples] bool
    temperature: torch.Tensor  # [samples] float32, 1 for greedy rows
    top_k: torch.Tensor  # [samples] int64, 0 = off
    top_p: torch.Tensor  # [samples] float32, 1 = off
    min_p: torch.Tensor  # [samples] float32, 0 = off
    seed_lo: torch.Tensor  # [samples] int64
    seed_hi: torch.Tensor
    step: torch.Tensor  # [samples] int64: tokens the request has sampled before this one
    repetition_penalty: torch.Tensor  # [samples] float32, 1 = off
    frequency_penalty: torch.Tensor  # [samples] float32, 0 = off
    presence_penalty: torch.Tensor  # [samples] float32, 0 = off


def needs_extras(params: SamplingParams, has_constraint: bool) -> bool:
    """Whether a row needs more than the sampling chain: bias, penalties or a mask."""
    return (
        has_constraint
        or bool(params.logit_bias)
        or params.repetition_penalty != 1
        or params.frequency_penalty != 0
        or params.presence_penalty != 0
    )


class SamplingExtras:
    """Per input-batch row, on the device: [rows, V] logit bias, output-token counts, seen tokens
    (prompt and output) and the allowed-token mask of the current step. Allocated by the input batch
    when the first request that needs them arrives; its rows are set when a request gets its row."""

    def __init__(self, num_rows: int, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.bias = torch.zeros(num_rows, vocab_size, dtype=torch.float32, device=device)
        self.counts = torch.zeros(num_rows, vocab_size, dtype=torch.int32, device=device)
        self.seen = torch.zeros(num_rows, vocab_size, dtype=torch.bool, device=device)
        self.allowed = torch.ones(num_rows, vocab_size, dtype=torch.bool, device=device)

    def reset_row(self, row: int, params: SamplingParams, prompt: list[int], output: list[int]) -> None:
        """A request's row from its settings and history (its output holds no pending token here:
        a request gets a row only when every token it has is known); a request without penalties
        needs no history, only a neutral bias and mask."""
        device = self.bias.device
        self.bias[row].zero_()
        if params.logit_bias:
            token_ids = torch.tensor(list(params.logit_bias), dtype=torch.int64, device=device)
            values = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32, device=device)
            self.bias[row].index_copy_(0, token_ids, values)
        self.counts[row].zero_()
        self.seen[row].zero_()
        self.allowed[row].fill_(True)
        if output:
            output_ids = torch.tensor(output, dtype=torch.int64, device=device)
            self.counts[row].index_add_(0, output_ids, torch.ones_like(output_ids, dtype=torch.int32))
            self.seen[row, output_ids] = True
        if prompt:
            self.seen[row, torch.tensor(prompt, dtype=torch.int64, device=device)] = True

    def record(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Each sampling row's new token joins its history (on the device, inside a graph)."""
        self.counts.index_put_((rows, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)
        self.seen.index_put_((rows, tokens), torch.ones_like(tokens, dtype=torch.bool))

    def process(self, logits: torch.Tensor, rows: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
        """Bias, then the repetition penalty, then frequency and presence, then the mask, as the host
        Sampler orders them (workers.engine.sample.sampler)."""
        processed = logits + self.bias.index_select(0, rows)
        seen = self.seen.index_select(0, rows)
        processed = sampling.apply_repetition_penalty(processed, seen, params.repetition_penalty)
        processed = sampling.apply_frequency_presence_penalties(
            processed, self.counts.index_select(0, rows), params.frequency_penalty, params.presence_penalty
        )
        return processed.masked_fill(~self.allowed.index_select(0, rows), -torch.inf)


@dataclass(frozen=True, slots=True)
class SampledLogprobs:
    """Device tensors of each sampled token's logprob under the raw logits."""

    chosen: torch.Tensor  # [samples] float32
    rank: torch.Tensor  # [samples] int64: 1 + tokens strictly more likely
    top_ids: torch.Tensor  # [samples, MAX_LOGPROBS] int64, most likely first, ties by lower id
    top_values: torch.Tensor  # [samples, MAX_LOGPROBS] float32


def sample(
    logits: torch.Tensor,
    params: SamplingTensors | None,
    mode: str,
    *,
    rows: torch.Tensor,
    extras: SamplingExtras | None,
) -> tuple[torch.Tensor, SampledLogprobs | None]:
    """[B] int64 token ids from [B, V] float32 logits (and their logprobs in "logprobs" mode); `rows`
    are the sequences' input-batch rows, whose history `extras` holds; `params` may be None in
    "greedy" mode."""
    if mode == "greedy":
        return sampling.argmax_rows(logits), None
    processed = extras.process(logits, rows, params) if mode in ("extras", "logprobs") else logits
    probs = sampling.temperature_softmax(processed, params.temperature)
    probs = sampling.top_k_mask(probs, params.top_k)
    probs = sampling.top_p_mask(probs, params.top_p)
    probs = sampling.min_p_mask(probs, params.min_p)
    noise = sampling.counter_exponential_noise(params.seed_lo, params.seed_hi, params.step, logits.shape[-1])
    tokens = torch.where(params.greedy, sampling.argmax_rows(processed), sampling.exponential_race(probs, noise))
    if extras is not None and mode in ("extras", "logprobs"):
        extras.record(rows, tokens)
    return tokens, _logprobs(logits, tokens) if mode == "logprobs" else None


def _logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> SampledLogprobs:
    logprobs = logits.log_softmax(dim=-1)
    chosen = logprobs.gather(1, tokens[:, None])
    ordered = logprobs.sort(dim=-1, descending=True, stable=True)
    return SampledLogprobs(
        chosen=chosen.squeeze(1),
        rank=(logprobs > chosen).sum(dim=-1) + 1,
        top_ids=ordered.indices[:, :MAX_LOGPROBS],
        top_values=ordered.values[:, :MAX_LOGPROBS],
    )


def logprobs_entry(
    token_id: int, chosen: float, rank: int, top_ids: list[int], top_values: list[float], k: int
) -> TokenLogprobs:
    """One sampled token's logprobs as the host Sampler reports them, with its top k."""
    return TokenLogprobs(token_id=token_id, logprob=chosen, rank=rank, top=list(zip(top_ids[:k], top_values[:k])))
