"""Sampling on the device with no host synchronisation: greedy argmax, temperature, top-k, top-p,
min-p and the exponential race over counter-based noise (per-row seeds and step indices as tensors).

Every op is row-local and takes its parameters as tensors, so one launch sequence serves rows with
different settings and can be captured in a CUDA graph. A greedy row takes the argmax of its raw
logits; the parameters of greedy rows are neutral (temperature 1), so they cost nothing but work.
Requests that also need logit bias, penalties, logprobs or an output constraint go through the
host-driven Sampler instead (see ModelRunner).
"""

from dataclasses import dataclass

import torch

from kernels import sampling
from workers.engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class SamplingTensors:
    """Per sampling sequence, its parameters on the device, for runner.device_sampling."""

    greedy: torch.Tensor  # [samples] bool
    temperature: torch.Tensor  # [samples] float32, 1 for greedy rows
    top_k: torch.Tensor  # [samples] int64, 0 = off
    top_p: torch.Tensor  # [samples] float32, 1 = off
    min_p: torch.Tensor  # [samples] float32, 0 = off
    seed_lo: torch.Tensor  # [samples] int64
    seed_hi: torch.Tensor
    step: torch.Tensor  # [samples] int64: tokens the request has sampled before this one


def needs_host_sampler(params: SamplingParams, has_constraint: bool) -> bool:
    """Whether a row needs the Sampler's extras rather than the on-device path."""
    return (
        has_constraint
        or params.logprobs is not None
        or bool(params.logit_bias)
        or params.repetition_penalty != 1
        or params.frequency_penalty != 0
        or params.presence_penalty != 0
    )


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


def sample_tokens(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """[B] int64 token ids from [B, V] float32 logits."""
    probs = sampling.temperature_softmax(logits, params.temperature)
    probs = sampling.top_k_mask(probs, params.top_k)
    probs = sampling.top_p_mask(probs, params.top_p)
    probs = sampling.min_p_mask(probs, params.min_p)
    noise = sampling.counter_exponential_noise(params.seed_lo, params.seed_hi, params.step, logits.shape[-1])
    return torch.where(params.greedy, logits.argmax(dim=-1), sampling.exponential_race(probs, noise))
