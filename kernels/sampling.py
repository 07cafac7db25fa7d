"""Sampling ops on a batch of logits: penalties, top-k / top-p / min-p masks, the exponential race.

Torch reference implementations; a Triton version will be tested against these. Every op works on
each row alone (no reduction crosses rows, and none whose order depends on the batch size), so a
request gets bitwise the same result whatever it is batched with. Per-row parameters are [B]
tensors on the logits' device, so rows with different settings share one launch.

The masks take non-negative weights (probabilities, not necessarily normalised) and zero what they
drop. Each keeps every token tied with the last one it keeps, which makes the result independent of
how a sort orders ties, and each always keeps the most likely token, so no row is ever emptied.
"""

import math

import torch
import torch.nn.functional as F

INDEX_DTYPE = torch.int64
MASK32 = 0xFFFFFFFF
# argmax_rows reduces rows in this many chunks (the largest power of two that divides the row length,
# up to it); with fewer than ARGMAX_MIN_CHUNKS it takes the one-pass argmax.
ARGMAX_CHUNKS = 64
ARGMAX_MIN_CHUNKS = 8
# Keys of the vocabulary's tokens for counter_exponential_noise, by (vocab size, device).
_TOKEN_KEYS: dict[tuple[int, torch.device], torch.Tensor] = {}


def token_counts(row_ids: torch.Tensor, token_ids: torch.Tensor, *, num_rows: int, vocab_size: int) -> torch.Tensor:
    """[num_rows, vocab_size] int32: how often each token occurs in each row, from flat
    (row id, token id) pairs. Ids must already be in range."""
    _check_index_vector("row_ids", row_ids)
    _check_index_vector("token_ids", token_ids)
    _check_same("token_ids shape", tuple(token_ids.shape), tuple(row_ids.shape))
    _check_same("token_ids device", token_ids.device, row_ids.device)
    counts = torch.zeros(num_rows * vocab_size, dtype=torch.int32, device=row_ids.device)
    ones = torch.ones_like(token_ids, dtype=torch.int32)
    counts.scatter_add_(0, row_ids * vocab_size + token_ids, ones)
    return counts.view(num_rows, vocab_size)


def add_logit_bias(
    logits: torch.Tensor, row_ids: torch.Tensor, token_ids: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    """logits with bias[i] added at (row_ids[i], token_ids[i]); each pair appears at most once."""
    _check_logits(logits)
    for name, tensor in (("row_ids", row_ids), ("token_ids", token_ids)):
        _check_index_vector(name, tensor)
        _check_same(f"{name} device", tensor.device, logits.device)
        _check_same(f"{name} shape", tuple(tensor.shape), tuple(bias.shape))
    _check_same("bias dtype", bias.dtype, logits.dtype)
    _check_same("bias device", bias.device, logits.device)
    biased = logits.clone()
    biased[row_ids, token_ids] = logits[row_ids, token_ids] + bias
    return biased


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """HF semantics: over the tokens seen in a row, positive logits are divided by the row's
    penalty and negative ones multiplied, so a penalty > 1 always makes them less likely."""
    _check_logits(logits)
    _check_same("seen shape", tuple(seen.shape), tuple(logits.shape))
    _check_same("seen dtype", seen.dtype, torch.bool)
    _check_same("seen device", seen.device, logits.device)
    _check_row_vector("penalty", penalty, logits)
    per_row = penalty[:, None]
    penalised = torch.where(logits > 0, logits / per_row, logits * per_row)
    return torch.where(seen, penalised, logits)


def apply_frequency_presence_penalties(
    logits: torch.Tensor, counts: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor
) -> torch.Tensor:
    """OpenAI semantics: logit -= frequency * count + presence * (count > 0)."""
    _check_logits(logits)
    _check_same("counts shape", tuple(counts.shape), tuple(logits.shape))
    _check_same("counts dtype", counts.dtype, torch.int32)
    _check_same("counts device", counts.device, logits.device)
    _check_row_vector("frequency", frequency, logits)
    _check_row_vector("presence", presence, logits)
    occurred = (counts > 0).to(logits.dtype)
    return logits - frequency[:, None] * counts.to(logits.dtype) - presence[:, None] * occurred


def temperature_softmax(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """softmax(logits / temperature) per row, for temperatures > 0.

    The logits are shifted by their row maximum before the division, so even a tiny temperature
    cannot overflow to inf (every scaled value is <= 0)."""
    _check_logits(logits)
    _check_row_vector("temperature", temperature, logits)
    shifted = logits - logits.amax(dim=-1, keepdim=True)
    return (shifted / temperature[:, None]).softmax(dim=-1)


def top_k_mask(probs: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep the k most likely tokens of each row and any tied with the k-th; k <= 0 or k >= V
    leaves the row unchanged."""
    _check_logits(probs, name="probs")
    _check_row_vector("top_k", top_k, probs, dtype=INDEX_DTYPE)
    vocab_size = probs.shape[-1]
    disabled = (top_k <= 0) | (top_k >= vocab_size)
    kth = torch.where(disabled, vocab_size, top_k) - 1
    sorted_probs = probs.sort(dim=-1, descending=True).values
    threshold = sorted_probs.gather(1, kth[:, None])
    return _keep(probs, (probs >= threshold) | disabled[:, None])


def top_p_mask(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest most-likely set of each row whose mass reaches top_p of the row's total
    (plus ties with its last member); top_p >= 1 leaves the row unchanged."""
    _check_logits(probs, name="probs")
    _check_row_vector("top_p", top_p, probs)
    sorted_probs = probs.sort(dim=-1, descending=True).values
    cumulative = sorted_probs.cumsum(dim=-1)
    # Mass strictly before each position, taken from the same cumsum so the prefix sums agree exactly.
    mass_before = F.pad(cumulative[:, :-1], (1, 0))
    target = top_p[:, None] * cumulative[:, -1:]
    kept = (mass_before < target).sum(dim=-1, keepdim=True).clamp_min(1)
    threshold = sorted_probs.gather(1, kept - 1)
    return _keep(probs, (probs >= threshold) | (top_p >= 1)[:, None])


def min_p_mask(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens less likely than min_p times the row's most likely token; min_p <= 1, so that
    token always survives, and min_p = 0 keeps everything."""
    _check_logits(probs, name="probs")
    _check_row_vector("min_p", min_p, probs)
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return _keep(probs, probs >= threshold)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """[B] int64: torch.argmax(x, dim=-1), the first index of each row's maximum, in two reductions
    over chunks of the row when the row splits evenly: one row reduced by one thread block (a
    decode step's few rows over a vocabulary) is serial work, 13 µs on an H200 for 49,152 logits."""
    _check_logits(x)
    vocab_size = x.shape[-1]
    chunks = math.gcd(vocab_size, ARGMAX_CHUNKS)
    if chunks < ARGMAX_MIN_CHUNKS or not x.is_contiguous():
        return x.argmax(dim=-1)
    best, within = x.view(x.shape[0], chunks, vocab_size // chunks).max(dim=-1)
    # The first chunk holding the row's maximum, and in it the maximum's first index: the row's first.
    chunk = best.argmax(dim=-1, keepdim=True)
    return chunk.squeeze(1) * (vocab_size // chunks) + within.gather(1, chunk).squeeze(1)


def exponential_race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """[B] int64: argmax(probs / noise) per row, a draw from probs when noise ~ Exp(1) i.i.d.

    Each token "arrives" after an exponential time with rate equal to its probability; the first
    arrival is distributed as probs. Zero noise is raised to the smallest normal float so a dropped
    token (prob 0) can never win through 0 / 0 = nan."""
    _check_logits(probs, name="probs")
    _check_same("noise shape", tuple(noise.shape), tuple(probs.shape))
    _check_same("noise dtype", noise.dtype, probs.dtype)
    _check_same("noise device", noise.device, probs.device)
    return (probs / noise.clamp_min(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)


def _keep(probs: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return torch.where(keep, probs, torch.zeros((), dtype=probs.dtype, device=probs.device))


def _check_logits(tensor: torch.Tensor, *, name: str = "logits") -> None:
    if tensor.dim() != 2 or tensor.shape[-1] == 0:
        raise ValueError(f"{name} must be [batch, vocab] with vocab > 0, got shape {tuple(tensor.shape)}")
    if not tensor.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {tensor.dtype}")


def _check_row_vector(
    name: str, tensor: torch.Tensor, rows_of: torch.Tensor, *, dtype: torch.dtype | None = None
) -> None:
    _check_same(f"{name} shape", tuple(tensor.shape), (rows_of.shape[0],))
    _check_same(f"{name} dtype", tensor.dtype, dtype or rows_of.dtype)
    _check_same(f"{name} device", tensor.device, rows_of.device)


def _check_index_vector(name: str, tensor: torch.Tensor) -> None:
    if tensor.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(tensor.shape)}")
    _check_same(f"{name} dtype", tensor.dtype, INDEX_DTYPE)


def _check_same(what: str, got: object, expected: object) -> None:
    if got != expected:
        raise ValueError(f"{what} must be {expected}, got {got}")


def seed_words(seed: int) -> tuple[int, int]:
    """A request's seed (any Python int) folded to 64 bits, as (low, high) 32-bit words."""
    folded = seed & ((1 << 64) - 1)
    return folded & MASK32, folded >> 32


def counter_exponential_noise(
    seed_lo: torch.Tensor, seed_hi: torch.Tensor, step: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """[B, V] float32 Exp(1) noise that depends only on (seed, step, token id) of each entry.

    A counter-based generator: every value is a hash of its coordinates, so a row's draw is the
    same alone or in any batch, after preemption, on any device, and inside a CUDA graph (no
    generator state to advance; seeds and steps are tensors). int64 tensors of 32-bit words.
    """
    for name, tensor in (("seed_lo", seed_lo), ("seed_hi", seed_hi), ("step", step)):
        _check_index_vector(name, tensor)
        _check_same(f"{name} shape", tuple(tensor.shape), tuple(seed_lo.shape))
    key = (vocab_size, seed_lo.device)
    if key not in _TOKEN_KEYS:
        tokens = torch.arange(vocab_size, dtype=INDEX_DTYPE, device=seed_lo.device)
        _TOKEN_KEYS[key] = _mix32(_mul32(tokens, 0x9E3779B1) ^ 0x5BD1E995)
    row = _mix32(_mix32(_mix32(seed_lo) ^ seed_hi) ^ (step & MASK32))
    bits = _mix32(_mix32(row[:, None] ^ _TOKEN_KEYS[key][None, :]) ^ row[:, None])
    # 24 random bits to a uniform in (0, 1), never 0 or 1; then the inverse CDF of Exp(1).
    uniform = ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    return -torch.log(uniform)


def _mul32(x: torch.Tensor, factor: int) -> torch.Tensor:
    """(x * factor) mod 2**32 for 32-bit x and factor, without overflowing int64."""
    high = (((x >> 16) * factor) & 0xFFFF) << 16
    return (high + (x & 0xFFFF) * factor) & MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (Wellons' lowbias32): every input bit flips about half the output bits."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)
