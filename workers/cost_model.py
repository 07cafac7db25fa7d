"""The prefill step-time model `cost(q, c)` the prefill scheduler and balancer plan with.

    cost(q, c) = a + b*q + d*q*q + e*q*c   seconds, for q new tokens over c cached tokens

Why these terms: `a` is the fixed cost of a step (launches, scheduling, the sampler); `b*q` is
everything computed per new token (projections, MLP, norms), linear in q; attention makes each new
token look at the c cached tokens (`e*q*c`) and at the new tokens before it (about q*q/2 pairs:
`d*q*q`). No c-only term: cached tokens are read by attention, which `e*q*c` already counts. Every
coefficient is a cost, so all four are fitted non-negative.

A batched step is the sum of its rows' terms plus one `a`; a decode step (q = 1 per request) is
therefore `a + (b + d)*batch + e*total_kv`, which is how the decode model is derived from the same fit
unless decode steps were measured on their own (`decode`, a DecodeCostModel): on a GPU, a decode step
replayed from a CUDA graph costs nothing like an eager prefill step of as many tokens, and its KV term,
lost in a prefill fit dominated by launch costs, is what a decode balancer weighs.
"""

import json
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from itertools import combinations
from pathlib import Path

import numpy as np

COST_MODEL_VERSION = 1
COEFFICIENTS = ("a", "b", "d", "e")
DECODE_COEFFICIENTS = ("a", "b", "e")


@dataclass(frozen=True, slots=True)
class StepSample:
    """One measured step: q new tokens over c cached tokens took `seconds`."""

    q: int
    c: int
    seconds: float


@dataclass(frozen=True, slots=True)
class DecodeSample:
    """One measured decode step: `batch` requests attending to `total_kv` cached tokens in all."""

    batch: int
    total_kv: int
    seconds: float


@dataclass(frozen=True, slots=True)
class DecodeCostModel:
    """A decode step: a + b*batch + e*total_kv seconds, fitted on measured decode steps."""

    a: float  # seconds per step
    b: float  # seconds per request in the step
    e: float  # seconds per cached token attended to

    def __post_init__(self) -> None:
        _check_coefficients(self, DECODE_COEFFICIENTS)

    def predict(self, batch: int, total_kv: int) -> float:
        return self.a + self.b * batch + self.e * total_kv


@dataclass(frozen=True, slots=True)
class FitReport:
    """Relative errors |predicted - actual| / actual of a model on some samples."""

    samples: int
    median_rel_error: float
    p90_rel_error: float
    max_rel_error: float


@dataclass(frozen=True, slots=True)
class PrefillCostModel:
    a: float  # seconds per step
    b: float  # seconds per new token
    d: float  # seconds per (new token)^2: attention among the new tokens
    e: float  # seconds per new token per cached token: attention over the context
    decode: DecodeCostModel | None = None  # decode steps fitted on their own, when they were measured

    def __post_init__(self) -> None:
        _check_coefficients(self, COEFFICIENTS)
        if self.decode is not None and not isinstance(self.decode, DecodeCostModel):
            raise ValueError(f"the decode model must be a DecodeCostModel, got {type(self.decode).__name__}")

    def predict(self, q: int, c: int = 0) -> float:
        return self.a + self.b * q + self.d * q * q + self.e * q * c

    def predict_step(self, rows: Sequence[tuple[int, int]]) -> float:
        """Seconds of one batched step computing (q, c) rows: one fixed cost plus each row's terms."""
        return self.a + sum(self.predict(q, c) - self.a for q, c in rows)

    def predict_prefill(self, tokens: int, cached: int, budget_s: float, *, limit: int) -> float:
        """Seconds to compute `tokens - cached` tokens in chunks, each the largest that fits `budget_s`."""
        total = 0.0
        done = cached
        while done < tokens:
            q = min(self.max_chunk(budget_s, done, limit=limit), tokens - done)
            total += self.predict(q, done)
            done += q
        return total

    def predict_decode_step(self, batch: int, total_kv: int) -> float:
        """One decode step: `batch` rows of q = 1 attending to `total_kv` tokens in all."""
        if batch <= 0:
            return 0.0
        if self.decode is not None:
            return self.decode.predict(batch, total_kv)
        return self.a + (self.b + self.d) * batch + self.e * total_kv

    @property
    def decode_per_request_s(self) -> float:
        """What one more request adds to a decode step, besides its KV."""
        return self.decode.b if self.decode is not None else self.b + self.d

    @property
    def decode_per_kv_token_s(self) -> float:
        """What one more cached token adds to a decode step."""
        return self.decode.e if self.decode is not None else self.e

    def max_chunk(self, budget_s: float, c: int, *, limit: int) -> int:
        """The largest q in [1, limit] with predict(q, c) <= budget_s; 1 when even that does not fit,
        so a step always makes progress."""
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        linear = self.b + self.e * c
        slack = budget_s - self.a
        if slack <= 0:
            return 1
        if self.d > 0:
            root = (-linear + math.sqrt(linear * linear + 4 * self.d * slack)) / (2 * self.d)
        elif linear > 0:
            root = slack / linear
        else:
            return limit
        q = max(1, min(limit, math.floor(root)))
        # The closed form can land one off in floating point: settle it against predict itself.
        while q > 1 and self.predict(q, c) > budget_s:
            q -= 1
        while q < limit and self.predict(q + 1, c) <= budget_s:
            q += 1
        return q

    def to_json(self) -> str:
        data = {"version": COST_MODEL_VERSION, **asdict(self)}
        if self.decode is None:
            del data["decode"]
        return json.dumps(data, indent=2)

    @classmethod
    def from_json(cls, text: str) -> "PrefillCostModel":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"cost model file is not JSON: {error}") from None
        if not isinstance(data, dict):
            raise ValueError(f"cost model file must hold a JSON object, got {type(data).__name__}")
        if data.get("version") != COST_MODEL_VERSION:
            raise ValueError(f"cost model version must be {COST_MODEL_VERSION}, got {data.get('version')!r}")
        missing = [name for name in COEFFICIENTS if name not in data]
        if missing:
            raise ValueError(f"cost model file lacks coefficients {missing}")
        decode = data.get("decode")
        if decode is not None:
            if not isinstance(decode, dict) or any(name not in decode for name in DECODE_COEFFICIENTS):
                raise ValueError(f"the cost model's decode entry must hold coefficients {list(DECODE_COEFFICIENTS)}")
            decode = DecodeCostModel(**{name: decode[name] for name in DECODE_COEFFICIENTS})
        return cls(**{name: data[name] for name in COEFFICIENTS}, decode=decode)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: Path) -> "PrefillCostModel":
        try:
            return cls.from_json(path.read_text())
        except OSError as error:
            raise ValueError(
                f"cannot read cost model {path}: {error.strerror} (fit one: python -m bench.fit_cost_model)"
            )
        except ValueError as error:
            raise ValueError(f"{path}: {error}") from None


def fit(samples: Sequence[StepSample]) -> tuple[PrefillCostModel, FitReport]:
    """Non-negative least squares on relative error (each row divided by its measured time), so
    short steps count as much as long ones; the report is the fit's error on the same samples."""
    if len(samples) < len(COEFFICIENTS):
        raise ValueError(f"need at least {len(COEFFICIENTS)} samples to fit, got {len(samples)}")
    if any(s.seconds <= 0 or s.q < 1 or s.c < 0 for s in samples):
        raise ValueError("samples need q >= 1, c >= 0 and a positive time")
    features = np.array([_features(s.q, s.c) for s in samples], dtype=np.float64)
    times = np.array([s.seconds for s in samples], dtype=np.float64)
    model = PrefillCostModel(*_nonnegative_lstsq(features / times[:, None], np.ones_like(times)))
    return model, evaluate(model, samples)


def fit_decode(samples: Sequence[DecodeSample]) -> tuple[DecodeCostModel, FitReport]:
    """The decode model by the same non-negative least squares on relative error."""
    if len(samples) < len(DECODE_COEFFICIENTS):
        raise ValueError(f"need at least {len(DECODE_COEFFICIENTS)} decode samples to fit, got {len(samples)}")
    if any(s.seconds <= 0 or s.batch < 1 or s.total_kv < 0 for s in samples):
        raise ValueError("decode samples need batch >= 1, total_kv >= 0 and a positive time")
    features = np.array([(1.0, float(s.batch), float(s.total_kv)) for s in samples], dtype=np.float64)
    times = np.array([s.seconds for s in samples], dtype=np.float64)
    model = DecodeCostModel(*_nonnegative_lstsq(features / times[:, None], np.ones_like(times)))
    return model, evaluate_decode(model, samples)


def evaluate_decode(model: DecodeCostModel, samples: Sequence[DecodeSample]) -> FitReport:
    return _report([abs(model.predict(s.batch, s.total_kv) - s.seconds) / s.seconds for s in samples])


def evaluate(model: PrefillCostModel, samples: Sequence[StepSample]) -> FitReport:
    return _report([abs(model.predict(s.q, s.c) - s.seconds) / s.seconds for s in samples])


def _report(relative_errors: list[float]) -> FitReport:
    errors = np.array(relative_errors)
    return FitReport(
        samples=len(errors),
        median_rel_error=float(np.median(errors)),
        p90_rel_error=float(np.quantile(errors, 0.9)),
        max_rel_error=float(errors.max()),
    )


def _check_coefficients(model: object, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(model, name)
        if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
            raise ValueError(f"cost model coefficient {name!r} must be a finite number, got {value!r}")
        if value < 0:
            raise ValueError(f"cost model coefficient {name!r} must be non-negative, got {value!r}")


def _features(q: int, c: int) -> tuple[float, float, float, float]:
    return (1.0, float(q), float(q) * q, float(q) * c)


def _nonnegative_lstsq(matrix: np.ndarray, target: np.ndarray) -> list[float]:
    """Exact NNLS for a handful of unknowns: the best unconstrained fit over every subset of free
    coefficients (the rest pinned at 0) that comes out non-negative. 2^4 small solves."""
    columns = matrix.shape[1]
    # Scale columns to comparable size, or lstsq's rank cut-off would drop the tiny q*c column.
    scale = np.linalg.norm(matrix, axis=0)
    scale[scale == 0] = 1.0
    scaled = matrix / scale
    best: tuple[float, np.ndarray] | None = None
    for size in range(1, columns + 1):
        for subset in combinations(range(columns), size):
            solution, *_ = np.linalg.lstsq(scaled[:, subset], target, rcond=None)
            if (solution < 0).any():
                continue
            full = np.zeros(columns)
            full[list(subset)] = solution
            residual = float(np.sum((scaled @ full - target) ** 2))
            if best is None or residual < best[0]:
                best = (residual, full)
    assert best is not None  # a single column always has a non-negative fit to a positive target
    return [float(value) for value in best[1] / scale]


class PredictionErrorTracker:
    """Rolling relative error of the model's predictions on a worker, for its heartbeat."""

    def __init__(self, window: int = 256) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self._errors: deque[float] = deque(maxlen=window)

    def record(self, predicted_s: float, actual_s: float) -> None:
        if actual_s > 0:
            self._errors.append(abs(predicted_s - actual_s) / actual_s)

    def percentiles(self) -> tuple[float, float]:
        """(p50, p90) relative error over the window; (0.0, 0.0) before any step was recorded."""
        if not self._errors:
            return 0.0, 0.0
        errors = np.array(self._errors)
        return float(np.quantile(errors, 0.5)), float(np.quantile(errors, 0.9))
