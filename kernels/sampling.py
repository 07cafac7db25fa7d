"""Sampling ops on a batch of logits: penalties, top-k / top-p / min-p masks, the exponential race.

Torch reference implementations; a Triton version will be tested against these. Every op works on
each row alone (no reduction crosses rows, and none whose order depends on the batch size), so a
request gets bitwise the same result whatever it is batched with. Per-row parameters are [B]
tensors on the logits' device, so rows with different settings share one launch.

The masks take non-negative weights (probabilities, not necessarily normalised) and zero what they
drop. Each keeps every token tied with the last one it keeps, which makes the result independent of
how a sort orders ties, and each always keeps the most likely token, so no row is ever emptied.
"""

import torch
import torch.nn.functional as F

INDEX_DTYPE = torch.int64


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
