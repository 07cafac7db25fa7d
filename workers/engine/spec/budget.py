"""How many draft tokens a verify step checks, in all and per request (`--spec-budget`).

Two policies behind one face (`SpecBudget`), so the engine never asks which it holds:
- `fixed`: every request verifies all its drafts (up to K).
- `dspark`: the host sets the step's total T from the step-time curve and lagged confidences
  (`plan_total`), and the device splits T among requests by greedy marginal allocation on this
  step's confidences (`allocate`), with no host sync.

Both take the batch's expected-accepted-prefix matrix E ([R, K], entry (r, j) the chance that
request r's drafts 0..j are all accepted; from `confidence.expected_accepted_prefix`). Verifying
draft j of r adds E[r, j] expected tokens, so the T entries with the most expected tokens are the T
largest of E. Entries below 0 are missing drafts (`NO_DRAFT`) and are never verified.

Why a prefix of each row: a row of E is non-increasing, and ties are broken by lower row, then lower
position; so if (r, j+1) is among the T largest, (r, j), no smaller and earlier in the order, is too.
`allocate` enforces the premise on any input by taking each row's running minimum (a no-op on a
proper E) and by dropping a row's drafts from its first missing or ineligible one.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from workers.args import SPEC_BUDGETS
from workers.cost_model import PrefillCostModel

# Seconds of a verify step against the number of tokens in it (R requests' own tokens plus the
# drafts verified), vectorised over an integer array.
StepSeconds = Callable[[np.ndarray], np.ndarray]

# Speculation must beat no speculation by this much (relative, in expected tokens per second) to run:
# the step-time fit is a few percent off, and a draft's gain is only an estimate.
VALVE_MARGIN = 0.02


@dataclass(frozen=True, slots=True)
class VerifyStepCurve:
    """The decode step of `batch` requests plus `per_draft_token_s` for each draft token verified.

    From the fitted decode model, a + b*tokens + e*total_kv: a draft token costs what one more
    decode row does (b) and no more KV reads, because a verify row of a few tokens reads its
    request's KV once, as a decode row does (attention at this size is bound by memory, not by
    arithmetic)."""

    batch: int
    decode_step_s: float
    per_draft_token_s: float

    def __post_init__(self) -> None:
        if self.batch < 1:
            raise ValueError(f"batch must be >= 1, got {self.batch}")
        for name in ("decode_step_s", "per_draft_token_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite non-negative number of seconds, got {value!r}")

    @classmethod
    def from_cost_model(cls, model: PrefillCostModel, *, batch: int, total_kv: int) -> "VerifyStepCurve":
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        if total_kv < 0:
            raise ValueError(f"total_kv must be >= 0, got {total_kv}")
        return cls(
            batch=batch,
            decode_step_s=model.predict_decode_step(batch, total_kv),
            per_draft_token_s=model.decode_per_request_s,
        )

    def __call__(self, tokens: np.ndarray) -> np.ndarray:
        return self.decode_step_s + (np.asarray(tokens, dtype=np.float64) - self.batch) * self.per_draft_token_s


class SpecBudget(Protocol):
    def plan_total(self, *, batch: int, step_seconds: StepSeconds | None, lagged_prefix: np.ndarray | None) -> int:
        """Draft tokens to verify this step, in all (host side, from statistics already on the host).
        `step_seconds` is None where the engine has no fitted cost model."""
        ...

    def allocate(self, expected_prefix: torch.Tensor, total: int | torch.Tensor) -> torch.Tensor:
        """Drafts each request verifies ([R] int64, on expected_prefix's device, sum <= total)."""
        ...


class FixedBudget:
    """Every request verifies all its drafts, up to `max_draft_tokens`."""

    def __init__(self, max_draft_tokens: int) -> None:
        self.max_draft_tokens = _check_max_draft_tokens(max_draft_tokens)

    def plan_total(self, *, batch: int, step_seconds: StepSeconds | None, lagged_prefix: np.ndarray | None) -> int:
        return _check_batch(batch) * self.max_draft_tokens

    def allocate(self, expected_prefix: torch.Tensor, total: int | torch.Tensor) -> torch.Tensor:
        """Only which drafts exist is read (any matrix with `NO_DRAFT` for the missing ones will do),
        and `total` is not: its own plan, batch * K, covers every draft."""
        _check_prefix_tensor(expected_prefix, self.max_draft_tokens)
        _check_total(total, expected_prefix)
        return _present_prefix(expected_prefix >= 0).sum(1)


class DSparkBudget:
    """The total from the step-time curve (`best_total`), split by greedy marginal allocation
    (`allocate_greedy`). Drafts whose expected-prefix entry is below `min_confidence` are never
    verified; speculation stops when its best rate is no more than `1 + margin` times the rate
    without it."""

    def __init__(self, max_draft_tokens: int, *, min_confidence: float = 0.0, margin: float = VALVE_MARGIN) -> None:
        self.max_draft_tokens = _check_max_draft_tokens(max_draft_tokens)
        self.min_confidence = _check_min_confidence(min_confidence)
        self.margin = _check_margin(margin)

    def plan_total(self, *, batch: int, step_seconds: StepSeconds | None, lagged_prefix: np.ndarray | None) -> int:
        """With nothing known yet (`lagged_prefix` None or empty: the first steps), verify every
        draft, as `fixed` would, so the calibrator sees outcomes at every position."""
        batch = _check_batch(batch)
        if step_seconds is None:
            raise ValueError("the dspark spec budget needs the step-time curve of a fitted cost model (cost_model)")
        if lagged_prefix is None or len(lagged_prefix) == 0:
            return batch * self.max_draft_tokens
        return best_total(
            lagged_prefix,
            batch=batch,
            step_seconds=step_seconds,
            min_confidence=self.min_confidence,
            margin=self.margin,
        )

    def allocate(self, expected_prefix: torch.Tensor, total: int | torch.Tensor) -> torch.Tensor:
        _check_prefix_tensor(expected_prefix, self.max_draft_tokens)
        _check_total(total, expected_prefix)
        return _greedy(expected_prefix, total, self.min_confidence)


def make_spec_budget(
    name: str, *, max_draft_tokens: int, min_confidence: float = 0.0, margin: float = VALVE_MARGIN
) -> SpecBudget:
    if name == "fixed":
        return FixedBudget(max_draft_tokens)
    if name == "dspark":
        return DSparkBudget(max_draft_tokens, min_confidence=min_confidence, margin=margin)
    raise ValueError(f"spec budget must be one of {', '.join(SPEC_BUDGETS)}, got {name!r}")


def best_total(
    lagged_prefix: np.ndarray,
    *,
    batch: int,
    step_seconds: StepSeconds,
    min_confidence: float = 0.0,
    margin: float = VALVE_MARGIN,
) -> int:
    """The T in [0, batch*K] maximising expected emitted tokens per second,
    (batch + sum of the T largest eligible entries of E) / step_seconds(batch + T); 0 unless that
    beats T = 0 by more than `margin`; the smallest such T on ties.

    Under async scheduling this step's E is still on the device, so E here is lagged: the previous
    step's matrix [R', K] copied to the host without blocking, or a per-position profile [1, K].
    Its sorted entries stand for the distribution of a row's gains; for a batch of R rows the sum of
    the T largest is taken as (R/R') times the lagged sum of the T*R'/R largest, interpolated
    linearly, which is exact when R' = R and when the R rows repeat the R' lagged ones."""
    batch = _check_batch(batch)
    _check_min_confidence(min_confidence)
    _check_margin(margin)
    lagged = np.asarray(lagged_prefix, dtype=np.float64)
    if lagged.ndim != 2 or lagged.shape[0] < 1 or lagged.shape[1] < 1:
        raise ValueError(
            f"lagged_prefix must be a non-empty [requests, draft positions] array, got shape {lagged.shape}"
        )
    if np.isnan(lagged).any() or (lagged > 1).any():
        raise ValueError("lagged_prefix entries must be probabilities <= 1 (negative for a missing draft)")
    if batch == 0:
        return 0
    rows, k = lagged.shape
    eligible = np.minimum.accumulate((lagged >= min_confidence).astype(np.int8), axis=1).astype(bool)
    gains = np.sort(np.minimum.accumulate(lagged, axis=1)[eligible])[::-1]
    lagged_sum = np.zeros(rows * k + 1)
    lagged_sum[1 : gains.size + 1] = np.cumsum(gains)
    lagged_sum[gains.size + 1 :] = lagged_sum[gains.size]
    totals = np.arange(batch * k + 1)
    scale = batch / rows
    expected = batch + scale * np.interp(totals / scale, np.arange(rows * k + 1), lagged_sum)
    seconds = np.asarray(step_seconds(batch + totals), dtype=np.float64)
    if seconds.shape != totals.shape or not np.isfinite(seconds).all() or (seconds <= 0).any():
        raise ValueError(f"step_seconds must map {totals.size} token counts to as many positive finite seconds")
    rate = expected / seconds
    best = int(np.argmax(rate))
    return best if rate[best] > rate[0] * (1.0 + margin) else 0


def allocate_greedy(
    expected_prefix: torch.Tensor, total: int | torch.Tensor, *, min_confidence: float = 0.0
) -> torch.Tensor:
    """Drafts per request ([R] int64): of the eligible entries of E (>= min_confidence, not
    missing), the `total` largest, ties to the lower row then the lower position, counted per row.
    Torch ops on E's device only (a stable sort and a scatter), so `total` may be a device tensor and
    nothing waits for the host."""
    _check_prefix_tensor(expected_prefix, None)
    _check_total(total, expected_prefix)
    return _greedy(expected_prefix, total, _check_min_confidence(min_confidence))


def _greedy(expected_prefix: torch.Tensor, total: int | torch.Tensor, min_confidence: float) -> torch.Tensor:
    rows, k = expected_prefix.shape
    eligible = _present_prefix((expected_prefix >= min_confidence) & (expected_prefix >= 0))
    value = torch.where(eligible, expected_prefix, -math.inf).cummin(1).values
    order = torch.sort(value.flatten(), descending=True, stable=True).indices
    within_total = torch.arange(rows * k, device=value.device) < total
    chosen = torch.zeros(rows * k, dtype=torch.bool, device=value.device).scatter(0, order, within_total)
    return (chosen.view(rows, k) & eligible).sum(1)


def _present_prefix(mask: torch.Tensor) -> torch.Tensor:
    """Each row's mask cut at its first False."""
    return mask.to(torch.int8).cummin(1).values.bool()


def _check_max_draft_tokens(value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"max_draft_tokens must be an int >= 1, got {value!r}")
    return value


def _check_min_confidence(value: float) -> float:
    if not (isinstance(value, int | float) and 0.0 <= value <= 1.0):
        raise ValueError(f"min_confidence must lie in [0, 1], got {value!r}")
    return float(value)


def _check_margin(value: float) -> float:
    if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
        raise ValueError(f"margin must be a finite number >= 0, got {value!r}")
    return float(value)


def _check_batch(batch: int) -> int:
    if not isinstance(batch, int | np.integer) or isinstance(batch, bool) or batch < 0:
        raise ValueError(f"batch must be an int >= 0, got {batch!r}")
    return int(batch)


def _check_prefix_tensor(expected_prefix: torch.Tensor, max_draft_tokens: int | None) -> None:
    if (
        not isinstance(expected_prefix, torch.Tensor)
        or expected_prefix.dim() != 2
        or not expected_prefix.dtype.is_floating_point
    ):
        raise ValueError("expected_prefix must be a floating-point [requests, draft positions] tensor")
    if max_draft_tokens is not None and expected_prefix.shape[1] > max_draft_tokens:
        raise ValueError(
            f"expected_prefix has {expected_prefix.shape[1]} draft positions, "
            f"more than max_draft_tokens={max_draft_tokens}"
        )
    # Values are checked only where that costs no device sync.
    if expected_prefix.device.type == "cpu" and bool((expected_prefix.isnan() | (expected_prefix > 1)).any()):
        raise ValueError("expected_prefix entries must be probabilities <= 1 (negative for a missing draft)")


def _check_total(total: int | torch.Tensor, expected_prefix: torch.Tensor) -> None:
    if isinstance(total, torch.Tensor):
        if total.dim() != 0 or total.dtype.is_floating_point or total.dtype == torch.bool:
            raise ValueError(
                f"total must be an int or a 0-d integer tensor, got a {total.dtype} of {tuple(total.shape)}"
            )
        if total.device != expected_prefix.device:
            raise ValueError(f"total is on {total.device}, expected_prefix on {expected_prefix.device}")
        if total.device.type == "cpu" and bool(total < 0):
            raise ValueError(f"total must be >= 0, got {int(total)}")
    elif not isinstance(total, int | np.integer) or isinstance(total, bool) or total < 0:
        raise ValueError(f"total must be an int >= 0, got {total!r}")
