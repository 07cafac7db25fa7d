"""Chooses the next token of every request in a step from the model's logits.

Order per row: logit_bias → repetition penalty → frequency/presence penalties → the output
constraint's mask of allowed tokens → greedy rows take the argmax; sampled rows: temperature →
top-k → top-p → min-p → exponential race. All of it is vectorised over the batch on the logits'
device and row-local, so a request's token and logprobs do not depend on what else is batched (the
tests hold this bitwise).

Randomness: a row with a seed draws its noise from a counter-based generator keyed by (seed, step
index, token id) (kernels.sampling.counter_exponential_noise), so its tokens survive preemption and
recompute, ignore batch composition, and are the same draw on the CPU and on CUDA, in eager steps
and in CUDA graphs. Rows without a seed share the sampler's own generator.
"""

import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from kernels import sampling
from workers.protocol.logprobs import TokenLogprobs
from workers.protocol.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class SamplingBatch:
    """One row per request that samples a token this step, in batch order."""

    params: Sequence[SamplingParams]
    prompt_token_ids: Sequence[Sequence[int]]
    output_token_ids: Sequence[Sequence[int]]  # tokens sampled so far; len() is the step index used for seeding
    # Per row, a bool [V] mask of the tokens an output constraint allows (any device), or None for
    # an unconstrained row; empty when no row is constrained.
    allowed_tokens: Sequence[torch.Tensor | None] = ()

    def __post_init__(self) -> None:
        rows = len(self.params)
        if len(self.prompt_token_ids) != rows or len(self.output_token_ids) != rows:
            raise ValueError(
                f"SamplingBatch needs one row each, got {rows} params, {len(self.prompt_token_ids)} prompts "
                f"and {len(self.output_token_ids)} outputs"
            )
        if self.allowed_tokens and len(self.allowed_tokens) != rows:
            raise ValueError(f"SamplingBatch has {len(self.allowed_tokens)} allowed-token masks for {rows} rows")

    @property
    def constrained_rows(self) -> list[int]:
        return [row for row, mask in enumerate(self.allowed_tokens) if mask is not None]


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # None for rows that did not ask for logprobs


class Sampler:
    def __init__(self, *, seed: int = 0) -> None:
        self._seed = seed
        self._unseeded_generators: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Sample one token per row of ``logits`` ([B, V] float32, any device).

        Logprobs come from the raw logits (log_softmax before bias, penalties, masks and
        temperature), as vLLM v1 reports them by default: they describe the model, not the sampling
        settings."""
        _check_logits(logits, batch)
        if not batch.constrained_rows and all(_is_plain_greedy(params) for params in batch.params):
            return SamplerOutput(token_ids=logits.argmax(dim=-1).tolist(), logprobs=[None] * len(batch.params))
        processed = _process_logits(logits, batch)
        token_ids = processed.argmax(dim=-1)
        sampled_rows = [row for row, params in enumerate(batch.params) if not params.is_greedy]
        if sampled_rows:
            rows = torch.tensor(sampled_rows, device=logits.device)
            token_ids.index_copy_(0, rows, self._sample(processed.index_select(0, rows), batch, sampled_rows))
        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=_token_logprobs(logits, token_ids, batch.params))

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch, rows: list[int]) -> torch.Tensor:
        params = [batch.params[row] for row in rows]
        device = logits.device
        probs = sampling.temperature_softmax(logits, _per_row([p.temperature for p in params], device))
        if any(p.top_k > 0 for p in params):
            probs = sampling.top_k_mask(probs, _per_row([p.top_k for p in params], device, torch.int64))
        if any(p.top_p < 1 for p in params):
            probs = sampling.top_p_mask(probs, _per_row([p.top_p for p in params], device))
        if any(p.min_p > 0 for p in params):
            probs = sampling.min_p_mask(probs, _per_row([p.min_p for p in params], device))
        steps = [len(batch.output_token_ids[row]) for row in rows]
        return sampling.exponential_race(probs, self._exponential_noise(params, steps, probs.shape[-1], device))

    def _exponential_noise(
        self, params: list[SamplingParams], steps: list[int], vocab_size: int, device: torch.device
    ) -> torch.Tensor:
        noise = torch.empty(len(params), vocab_size, dtype=torch.float32, device=device)
        unseeded = [index for index, p in enumerate(params) if p.seed is None]
        if unseeded:
            draws = torch.empty(len(unseeded), vocab_size, dtype=torch.float32, device=device)
            draws.exponential_(generator=self._generator(device))
            noise.index_copy_(0, torch.tensor(unseeded, device=device), draws)
        seeded = [index for index, p in enumerate(params) if p.seed is not None]
        if seeded:
            words = [sampling.seed_words(params[index].seed) for index in seeded]
            columns = [[w[0] for w in words], [w[1] for w in words], [steps[index] for index in seeded]]
            seed_lo, seed_hi, step = torch.tensor(columns, dtype=torch.int64, device=device)
            draws = sampling.counter_exponential_noise(seed_lo, seed_hi, step, vocab_size)
            noise.index_copy_(0, torch.tensor(seeded, device=device), draws)
        return noise

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._unseeded_generators:
            self._unseeded_generators[device] = torch.Generator(device=device)
            self._unseeded_generators[device].manual_seed(self._seed)
        return self._unseeded_generators[device]


def _is_plain_greedy(params: SamplingParams) -> bool:
    """Greedy with nothing to change the logits or report: the argmax of the raw logits is the answer."""
    return (
        params.is_greedy
        and params.logprobs is None
        and not params.logit_bias
        and params.repetition_penalty == 1
        and params.frequency_penalty == 0
        and params.presence_penalty == 0
    )


def _process_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Bias and penalties, applied only to the rows that ask for them (out of place)."""
    processed = logits
    vocab_size = logits.shape[-1]
    device = logits.device
    biased = [row for row, p in enumerate(batch.params) if p.logit_bias]
    if biased:
        processed = sampling.add_logit_bias(processed, *_flat_logit_bias(batch.params, biased, vocab_size, device))
    repeated = [row for row, p in enumerate(batch.params) if p.repetition_penalty != 1]
    if repeated:
        seen_tokens = [itertools.chain(batch.prompt_token_ids[row], batch.output_token_ids[row]) for row in repeated]
        seen = _token_counts(seen_tokens, vocab_size, device) > 0
        penalty = _per_row([batch.params[row].repetition_penalty for row in repeated], device)
        processed = _update_rows(
            processed, repeated, lambda rows: sampling.apply_repetition_penalty(rows, seen, penalty)
        )
    openai = [row for row, p in enumerate(batch.params) if p.frequency_penalty != 0 or p.presence_penalty != 0]
    if openai:
        counts = _token_counts([batch.output_token_ids[row] for row in openai], vocab_size, device)
        frequency = _per_row([batch.params[row].frequency_penalty for row in openai], device)
        presence = _per_row([batch.params[row].presence_penalty for row in openai], device)
        processed = _update_rows(
            processed,
            openai,
            lambda rows: sampling.apply_frequency_presence_penalties(rows, counts, frequency, presence),
        )
    constrained = batch.constrained_rows
    if constrained:
        allowed = _allowed_token_masks([batch.allowed_tokens[row] for row in constrained], vocab_size, device)
        processed = _update_rows(processed, constrained, lambda rows: rows.masked_fill(~allowed, -torch.inf))
    return processed


def _allowed_token_masks(masks: list[torch.Tensor], vocab_size: int, device: torch.device) -> torch.Tensor:
    for mask in masks:
        if mask.dtype != torch.bool or tuple(mask.shape) != (vocab_size,):
            raise ValueError(f"an allowed-token mask must be bool [{vocab_size}], got {mask.dtype} {tuple(mask.shape)}")
    return torch.stack(masks).to(device)


def _update_rows(logits: torch.Tensor, rows: list[int], op: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    index = torch.tensor(rows, device=logits.device)
    return logits.index_copy(0, index, op(logits.index_select(0, index)))


def _flat_logit_bias(
    params: Sequence[SamplingParams], rows: list[int], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(batch row, token id, bias) of every bias entry, as three flat tensors."""
    entries = [(row, token_id, bias) for row in rows for token_id, bias in params[row].logit_bias.items()]
    for _, token_id, _ in entries:
        if token_id >= vocab_size:
            raise ValueError(f"logit_bias token id {token_id} >= vocab size {vocab_size}")
    row_ids, token_ids, bias = zip(*entries, strict=True)
    return (
        _per_row(row_ids, device, torch.int64),
        _per_row(token_ids, device, torch.int64),
        _per_row(bias, device),
    )


def _token_counts(rows: Sequence[Iterable[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[len(rows), V] int32 counts, built on the host and checked there before the device sees ids."""
    per_row = [list(tokens) for tokens in rows]
    token_ids = torch.tensor(list(itertools.chain.from_iterable(per_row)), dtype=torch.int64)
    if token_ids.numel() and (int(token_ids.min()) < 0 or int(token_ids.max()) >= vocab_size):
        raise ValueError(
            f"token ids must be in [0, {vocab_size}), got [{int(token_ids.min())}, {int(token_ids.max())}]"
        )
    row_ids = torch.repeat_interleave(torch.arange(len(per_row)), torch.tensor([len(t) for t in per_row]))
    return sampling.token_counts(row_ids.to(device), token_ids.to(device), num_rows=len(per_row), vocab_size=vocab_size)


def _per_row(values: Sequence[float], device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def _token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, params: Sequence[SamplingParams]
) -> list[TokenLogprobs | None]:
    rows = [row for row, p in enumerate(params) if p.logprobs is not None]
    result: list[TokenLogprobs | None] = [None] * len(params)
    if not rows:
        return result
    index = torch.tensor(rows, device=logits.device)
    chosen = token_logprobs(
        logits.index_select(0, index), token_ids.index_select(0, index), [params[row].logprobs for row in rows]
    )
    for row, entry in zip(rows, chosen, strict=True):
        result[row] = entry
    return result


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: Sequence[int]) -> list[TokenLogprobs]:
    """Row i: the logprob and rank of token_ids[i] under raw logits[i], with its top num_top[i]."""
    logprobs = logits.log_softmax(dim=-1)
    chosen = logprobs.gather(1, token_ids[:, None])
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top_ids, top_values = _top_logprobs(logprobs, max(num_top))
    return [
        TokenLogprobs(
            token_id=token_id,
            logprob=logprob,
            rank=rank,
            top=list(zip(top_ids[position][:k], top_values[position][:k], strict=True)),
        )
        for position, (token_id, logprob, rank, k) in enumerate(
            zip(token_ids.tolist(), chosen.squeeze(1).tolist(), ranks.tolist(), num_top, strict=True)
        )
    ]


def _top_logprobs(logprobs: torch.Tensor, count: int) -> tuple[list[list[int]], list[list[float]]]:
    if count == 0:
        return [[] for _ in logprobs], [[] for _ in logprobs]
    # A stable sort orders tied tokens by id whatever else is in the batch; topk does not promise that.
    ordered = logprobs.sort(dim=-1, descending=True, stable=True)
    return ordered.indices[:, :count].tolist(), ordered.values[:, :count].tolist()


def _check_logits(logits: torch.Tensor, batch: SamplingBatch) -> None:
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"logits must be [batch, vocab] float32, got {tuple(logits.shape)} {logits.dtype}")
    if logits.shape[0] != len(batch.params):
        raise ValueError(f"logits has {logits.shape[0]} rows but the batch has {len(batch.params)}")
