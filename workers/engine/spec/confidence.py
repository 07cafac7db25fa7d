"""How likely each draft token is to be accepted: the drafter's own probability, calibrated online.

One `AcceptanceCalibrator` per drafter. For each draft position j (0..K-1) it keeps `bins` fixed
bins of the drafter's raw probability, each with a decayed count of drafts judged and of drafts
accepted. A draft is judged when it was verified and every draft before it was accepted, so the
estimate is the chance of acceptance given the drafts before it were accepted: what the cumulative
product (`expected_accepted_prefix`) multiplies. A bin's acceptance rate starts at its own centre (a
prior worth `prior_strength` outcomes: an unseen drafter is trusted as it is), and the rates of a
position are made monotone non-decreasing in the raw probability by isotonic regression, so a
likelier draft never gets a lower estimate. `calibrate` interpolates linearly between bin centres.

Memory is fixed (one [2, 3, K, bins] array of sums and the [K, bins] map) and tracks drift by
exponential decay rather than a window: a window would store every outcome in it, decay needs only
the sums. The decay is per outcome of each position, not per step, so the memory is the same number
of outcomes (`half_life` halves a sum) at batch 1 and at batch 200, and the statistical precision of
a bin does not depend on load.

`calibrate`, `observe` and `expected_accepted_prefix` run on the tensors' device with no host sync
(no `.item()`, no branching on values), so they fit an asynchronously scheduled step; on a CPU
tensor they also check values, which costs no device sync. `calibration_error` reads the counts
back to the host: call it off the hot path.

A missing draft (a row with fewer than K drafts) has raw probability `NO_DRAFT`; it stays `NO_DRAFT`
through `calibrate` and `expected_accepted_prefix`, and the budget never verifies it.
"""

import math
from dataclasses import dataclass

import torch

NO_DRAFT = -1.0
RAW, SCORED = 0, 1  # binnings of AcceptanceCalibrator's sums
OUTCOMES, ACCEPTED, PREDICTED = 0, 1, 2  # its quantities


@dataclass(frozen=True, slots=True)
class CalibrationError:
    """Expected calibration error (|accepted rate - predicted| per bin, weighted by outcomes) over
    the recent outcomes, of the calibrated estimate as it was when each outcome came in."""

    overall: float  # over all positions, bins of the calibrated probability pooled across positions
    per_position: tuple[float, ...]  # per draft position; 0.0 where none was observed yet
    raw_overall: float  # the drafter's own probability on the same outcomes, for comparison
    outcomes: float  # decayed number of outcomes behind these figures


class AcceptanceCalibrator:
    def __init__(
        self,
        max_draft_tokens: int,
        *,
        bins: int = 20,
        prior_strength: float = 4.0,
        half_life: float = 4096.0,
        device: torch.device | str = "cpu",
    ) -> None:
        if not isinstance(max_draft_tokens, int) or max_draft_tokens < 1:
            raise ValueError(f"max_draft_tokens must be an int >= 1, got {max_draft_tokens!r}")
        if not isinstance(bins, int) or bins < 2:
            raise ValueError(f"bins must be an int >= 2, got {bins!r}")
        if not (isinstance(prior_strength, int | float) and math.isfinite(prior_strength) and prior_strength > 0):
            raise ValueError(f"prior_strength must be a positive number, got {prior_strength!r}")
        if not (isinstance(half_life, int | float) and math.isfinite(half_life) and half_life > 0):
            raise ValueError(f"half_life must be a positive number of outcomes, got {half_life!r}")
        self.max_draft_tokens = max_draft_tokens
        self.bins = bins
        self.prior_strength = float(prior_strength)
        self.half_life = float(half_life)
        self.device = torch.empty(0, device=device).device  # "cuda" made concrete ("cuda:0"), as tensors report it
        self._centres = ((torch.arange(bins, device=self.device, dtype=torch.float32) + 0.5) / bins).expand(
            max_draft_tokens, bins
        )
        # Decayed sums per (binning, quantity, position, bin). Binning RAW is by the drafter's
        # probability: the calibration is fitted on it, and it scores the drafter's own error.
        # Binning SCORED is by the calibrated probability given before the outcome: its error.
        # Quantities: OUTCOMES (drafts judged), ACCEPTED, PREDICTED (the sum of the probabilities
        # that binning's estimate gave them).
        self._sums = torch.zeros((2, 3, max_draft_tokens, bins), device=self.device)
        # [binning, quantity, 1, 1]: where each block of the sums starts in their flat view.
        self._block_starts = torch.arange(6, device=self.device).view(2, 3, 1, 1) * max_draft_tokens * bins
        self.table = self._centres.clone()  # [K, bins] calibrated acceptance at each bin centre

    def calibrate(self, raw: torch.Tensor) -> torch.Tensor:
        """Acceptance probability (float32, [R, k]) of each draft from its raw probability [R, k],
        column j being draft position j (k <= max_draft_tokens); `NO_DRAFT` entries stay `NO_DRAFT`."""
        self._check_raw(raw)
        present = raw >= 0
        # Between bin centres (u = 0 at the first centre, bins - 1 at the last), flat beyond them.
        u = (raw.float().nan_to_num(0.0).clamp(0.0, 1.0) * self.bins - 0.5).clamp(0.0, self.bins - 1.0)
        low = u.floor().clamp(max=self.bins - 2)
        frac = u - low
        flat = self._flat_index(low.long())
        table = self.table.flatten()
        value = table[flat] * (1.0 - frac) + table[flat + 1] * frac
        return torch.where(present, value, NO_DRAFT)

    def observe(
        self,
        raw: torch.Tensor,
        verified: torch.Tensor,
        accepted: torch.Tensor,
        *,
        calibrated: torch.Tensor | None = None,
    ) -> None:
        """Learn from one verify step: row r verified its first `verified[r]` drafts (raw
        probabilities `raw[r]`) and accepted the first `accepted[r]` of them. Drafts at positions
        >= verified[r] were not verified, and drafts after the first rejected one were not judged on
        their own: neither teaches anything. `calibrated`: `calibrate(raw)` as the caller already
        computed it since the last observe (the estimate the outcomes are scored against)."""
        self._check_raw(raw)
        rows, k = raw.shape
        for name, value in (("verified", verified), ("accepted", accepted)):
            if value.shape != (rows,):
                raise ValueError(f"{name} must have shape ({rows},) like raw's rows, got {tuple(value.shape)}")
            if value.dtype.is_floating_point or value.dtype == torch.bool:
                raise ValueError(f"{name} must be an integer tensor, got {value.dtype}")
            if value.device != raw.device:
                raise ValueError(f"{name} is on {value.device}, raw on {raw.device}")
        if raw.device.type == "cpu":
            if bool(((verified < 0) | (verified > k)).any()):
                raise ValueError(f"verified counts must lie in [0, {k}], got {verified.tolist()}")
            if bool(((accepted < 0) | (accepted > verified)).any()):
                raise ValueError(f"accepted counts must lie in [0, verified], got {accepted.tolist()}")
        # A draft after the first rejection was checked against the target's reply to a wrong
        # token: it says nothing about itself.
        position = torch.arange(k, device=raw.device)
        accepted = torch.minimum(accepted, verified)[:, None]
        seen = (position < verified[:, None]) & (position <= accepted) & (raw >= 0)
        hit = (seen & (position < accepted)).float()
        seen = seen.float()
        probability = raw.float().nan_to_num(0.0).clamp(0.0, 1.0)
        # Before this step's outcomes: an honest score.
        predicted = (self.calibrate(raw) if calibrated is None else calibrated).clamp(0.0, 1.0)

        decay = torch.exp2(-seen.sum(0) / self.half_life)[:, None]
        self._sums[:, :, :k] *= decay
        bins = torch.stack([self._bin(probability), self._bin(predicted)])  # [binning, R, k]
        cell = (position * self.bins + bins)[:, None] + self._block_starts  # [binning, quantity, R, k]
        amount = torch.stack([torch.stack([seen, hit, estimate * seen]) for estimate in (probability, predicted)])
        self._sums.view(-1).scatter_add_(0, cell.flatten(), amount.flatten())
        self._refit()

    def calibration_error(self) -> CalibrationError:
        """The calibration error over recent outcomes, as host floats for metrics (reads the device)."""
        sums = self._sums.double().cpu()
        gap = (sums[:, ACCEPTED] - sums[:, PREDICTED]).abs()  # [binning, position, bin]
        per_outcomes = sums[SCORED, OUTCOMES].sum(1)
        outcomes = float(per_outcomes.sum())
        pooled = float((sums[SCORED, ACCEPTED].sum(0) - sums[SCORED, PREDICTED].sum(0)).abs().sum())
        return CalibrationError(
            overall=pooled / outcomes if outcomes > 0 else 0.0,
            per_position=tuple(float(e / n) if n > 0 else 0.0 for e, n in zip(gap[SCORED].sum(1), per_outcomes)),
            raw_overall=float(gap[RAW].sum()) / outcomes if outcomes > 0 else 0.0,
            outcomes=outcomes,
        )

    def _refit(self) -> None:
        """Isotonic regression of each position's bin rates, by the min-max formula
        fit(i) = max_{a<=i} min_{b>=i} mean(a..b) (Barlow et al. 1972, Thm 1.4): the same fit a
        pool-adjacent-violators pass finds, in fixed-shape tensor ops with no data-dependent loop."""
        weight = self._sums[RAW, OUTCOMES] + self.prior_strength
        total = self._sums[RAW, ACCEPTED] + self.prior_strength * self._centres
        zero = torch.zeros((self.max_draft_tokens, 1), device=self.device)
        cum_weight = torch.cat([zero, weight.cumsum(1)], 1)
        cum_total = torch.cat([zero, total.cumsum(1)], 1)
        # mean[a, b] of bins a..b, for a <= b.
        mean = (cum_total[:, None, 1:] - cum_total[:, :-1, None]) / (cum_weight[:, None, 1:] - cum_weight[:, :-1, None])
        index = torch.arange(self.bins, device=self.device)
        below = index[:, None] <= index[None, :]  # [a, b]: a <= b
        mean = torch.where(below, mean, math.inf)
        tail_min = mean.flip(2).cummin(2).values.flip(2)  # [a, i]: min over b >= i of mean(a..b)
        # In place, so a CUDA graph that captured `calibrate` reads the new map.
        self.table.copy_(torch.where(below, tail_min, -math.inf).amax(1).clamp(0.0, 1.0))

    def _bin(self, probability: torch.Tensor) -> torch.Tensor:
        return (probability * self.bins).long().clamp(0, self.bins - 1)

    def _flat_index(self, bin_index: torch.Tensor) -> torch.Tensor:
        """Index into a flattened [K, bins] array of column j's bins."""
        position = torch.arange(bin_index.shape[1], device=bin_index.device)
        return position * self.bins + bin_index

    def _check_raw(self, raw: torch.Tensor) -> None:
        if not isinstance(raw, torch.Tensor) or raw.dim() != 2:
            raise ValueError(f"raw must be a [requests, draft positions] tensor, got {_shape(raw)}")
        if raw.shape[1] > self.max_draft_tokens:
            raise ValueError(
                f"raw has {raw.shape[1]} draft positions, more than max_draft_tokens={self.max_draft_tokens}"
            )
        if not raw.dtype.is_floating_point:
            raise ValueError(f"raw must hold floating-point probabilities, got {raw.dtype}")
        if raw.device != self.device:
            raise ValueError(f"raw is on {raw.device}, the calibrator on {self.device}")
        if raw.device.type == "cpu":
            bad = (((raw < 0) | (raw > 1)) & (raw != NO_DRAFT) | raw.isnan()).nonzero()
            if len(bad):
                row, position = bad[0].tolist()
                raise ValueError(
                    f"raw probabilities must lie in [0, 1] (or be NO_DRAFT={NO_DRAFT}), "
                    f"got {raw[row, position].item()} at request {row}, position {position}"
                )


def expected_accepted_prefix(calibrated: torch.Tensor) -> torch.Tensor:
    """[R, k]: entry j is the chance that drafts 0..j are all accepted (the cumulative product), so a
    row's sum is the expected accepted length of verifying all of it. Entries from a row's first
    `NO_DRAFT` on are `NO_DRAFT`. Each row is non-increasing: a product of factors in [0, 1] never
    grows, in floating point too (rounding is monotone and x itself is representable)."""
    if not isinstance(calibrated, torch.Tensor) or calibrated.dim() != 2 or not calibrated.dtype.is_floating_point:
        raise ValueError(
            f"calibrated must be a floating-point [requests, draft positions] tensor, got {_shape(calibrated)}"
        )
    present = (calibrated >= 0).int().cummin(1).values.bool()
    prefix = torch.where(present, calibrated.clamp(0.0, 1.0), 0.0).cumprod(1)
    return torch.where(present, prefix, NO_DRAFT)


def _shape(value: object) -> str:
    return f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
