"""DSpark's verification budget against fixed K = 5 and against no speculation, simulated on
SYNTHETIC acceptance traces and the step-time curve of a measured decode cost fit.

    python -m bench.spec_budget [--cost-model bench/results/cost_model_h200.json]
        [--per-token-scale 1.0] [--concurrency 1 16 64 96 200] [--steps 600] [--seed 0]
        [--out bench/results/spec_budget_synthetic_h200_fit.json] [--quick]

Real: the calibrator (workers.engine.spec.confidence) and the budget (workers.engine.spec.budget),
called as the engine calls them: each step's total is planned on the host from the previous step's
expected-prefix matrix (lagged, as under async scheduling), and split among requests on this step's;
every verify step's outcomes go back to the calibrator. Step times come from the decode fit of
`--cost-model` (by default SmolLM2 measured on an H200) through `VerifyStepCurve`.
`--per-token-scale` multiplies the fit's per-token cost b: a what-if for a model whose step is more
memory-bound than SmolLM2's (a large model's weights make a few more tokens nearly free); the JSON
records it, and anything but 1 is no longer the measured curve.

Synthetic, and labelled so in the JSON: which drafts are accepted. Each request has a base
predictability (a logit drawn from N(1.9, 1), which puts fixed K = 5 near DeepSeek's 3.29 accepted
length) that wanders along its output (AR(1), rho 0.9, sd 0.8); draft j proposed at output position
t is accepted with probability p = sigmoid(predictability[t + j] - 0.3 j), and the drafter reports an
overconfident, noisy probability sigmoid(1.4 logit(p) + 0.4 + N(0, 0.4)), which the calibrator has
to correct.

The peers run in the same process on the same requests: every policy serves, in each of
`concurrency` slots, the same sequence of requests, and a request's drafts and their outcomes depend
only on its position in its own output, never on the step, so the policies differ only in what they
verify. A request emits its accepted drafts plus the target's own token each step (the accepted
length); drafts past its output length are not proposed. Not modelled: the drafter's cost (the same
for both speculative policies, which draft K each step), padding of verify steps to CUDA-graph
buckets, and the prefill. Prints the JSON and writes it to --out.
"""

import argparse
import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from workers.cost_model import PrefillCostModel
from workers.engine.spec.budget import DSparkBudget, FixedBudget, VerifyStepCurve
from workers.engine.spec.confidence import NO_DRAFT, AcceptanceCalibrator, expected_accepted_prefix

K = 5
POLICIES = ("none", "fixed_k5", "dspark")
# DeepSeek's published figures for DSpark against fixed K = 5, as ratios.
TARGETS = {
    "verified_ratio_max": 0.7,
    "accepted_length_ratio_min": 0.97,
    "throughput_ratio_at_64_min": 1.05,
    "throughput_vs_none_min": 0.98,
}


@dataclass(frozen=True, slots=True)
class SyntheticRequest:
    prompt_tokens: int
    raw: np.ndarray  # [output length, K] the drafter's probability of draft j at output position t
    accepted: np.ndarray  # [output length, K] whether the target accepts it (given the drafts before)

    @property
    def length(self) -> int:
        return self.raw.shape[0]


def make_request(seed: int, index: int) -> SyntheticRequest:
    rng = np.random.default_rng([seed, index])
    length = int(rng.integers(100, 400))
    rho, sd = 0.9, 0.8
    wander = np.zeros(length + K)
    for t in range(1, length + K):
        wander[t] = rho * wander[t - 1] + np.sqrt(1 - rho * rho) * sd * rng.normal()
    predictability = rng.normal(1.9, 1.0) + wander
    position = np.arange(K)
    true_logit = predictability[np.arange(length)[:, None] + position] - 0.3 * position
    raw_logit = 1.4 * true_logit + 0.4 + rng.normal(0.0, 0.4, (length, K))
    return SyntheticRequest(
        prompt_tokens=int(rng.integers(200, 2000)),
        raw=1.0 / (1.0 + np.exp(-raw_logit)),
        accepted=rng.random((length, K)) < 1.0 / (1.0 + np.exp(-true_logit)),
    )


class Requests:
    """Slot s serves requests s, s + slots, s + 2*slots, ...; shared by the policies of one concurrency."""

    def __init__(self, seed: int, slots: int) -> None:
        self.seed, self.slots = seed, slots
        self._made: dict[int, SyntheticRequest] = {}

    def get(self, index: int) -> SyntheticRequest:
        if index not in self._made:
            self._made[index] = make_request(self.seed, index)
        return self._made[index]


def simulate(policy: str, requests: Requests, model: PrefillCostModel, steps: int) -> dict[str, float]:
    slots = requests.slots
    current = list(range(slots))  # request index per slot
    emitted_so_far = np.zeros(slots, dtype=np.int64)
    calibrator = AcceptanceCalibrator(K)
    dspark, fixed = DSparkBudget(K), FixedBudget(K)
    lagged: np.ndarray | None = None
    seconds = emitted_total = verified_total = accepted_total = planned_total = valve_steps = 0.0
    for _ in range(steps):
        batch = [requests.get(i) for i in current]
        left = np.array([r.length for r in batch]) - emitted_so_far
        raw = np.stack([r.raw[t] for r, t in zip(batch, emitted_so_far)])
        accept = np.stack([r.accepted[t] for r, t in zip(batch, emitted_so_far)])
        # The target's own token is the last a request may still emit: no drafts past it.
        raw = np.where(np.arange(K) < (left - 1)[:, None], raw, NO_DRAFT)
        curve = VerifyStepCurve.from_cost_model(
            model, batch=slots, total_kv=int(sum(r.prompt_tokens for r in batch) + emitted_so_far.sum())
        )
        raw_t = torch.from_numpy(raw).float()
        if policy == "none":
            lengths = torch.zeros(slots, dtype=torch.int64)
            planned = 0
        elif policy == "fixed_k5":
            planned = fixed.plan_total(batch=slots, step_seconds=curve, lagged_prefix=None)
            lengths = fixed.allocate(raw_t, planned)  # fixed reads only which drafts exist
        else:
            prefix = expected_accepted_prefix(calibrator.calibrate(raw_t))
            planned = dspark.plan_total(batch=slots, step_seconds=curve, lagged_prefix=lagged)
            lengths = dspark.allocate(prefix, planned)
            lagged = prefix.numpy()
        run = torch.from_numpy(accept).int().cumprod(1).sum(1)
        accepted = torch.minimum(run, lengths)
        if policy == "dspark":
            calibrator.observe(raw_t, lengths, accepted)
        verified = int(lengths.sum())
        seconds += float(curve(np.array([slots + verified]))[0])
        emitted = accepted.numpy() + 1
        emitted_total += int(emitted.sum())
        verified_total += verified
        accepted_total += int(emitted.sum())
        planned_total += planned
        valve_steps += planned == 0
        emitted_so_far += emitted
        for slot in np.flatnonzero(emitted_so_far >= np.array([r.length for r in batch])):
            current[slot] += slots
            emitted_so_far[slot] = 0
    request_steps = steps * slots
    row = {
        "output_tokens_per_s": round(emitted_total / seconds, 1),
        "per_user_tokens_per_s": round(emitted_total / seconds / slots, 1),
        "verified_draft_tokens_per_request_step": round(verified_total / request_steps, 3),
        "accepted_length": round(accepted_total / request_steps, 3),
        "simulated_seconds": round(seconds, 4),
    }
    if policy == "dspark":
        error = calibrator.calibration_error()
        row |= {
            "planned_budget_per_request_step": round(planned_total / request_steps, 3),
            "steps_without_speculation": round(valve_steps / steps, 3),
            "calibration_error": round(error.overall, 4),
            "drafter_calibration_error": round(error.raw_overall, 4),
        }
    return row


def compare(concurrency: int, model: PrefillCostModel, steps: int, seed: int) -> dict[str, object]:
    requests = Requests(seed, concurrency)
    rows = {policy: simulate(policy, requests, model, steps) for policy in POLICIES}
    dspark, fixed, none = rows["dspark"], rows["fixed_k5"], rows["none"]
    return {
        "concurrency": concurrency,
        **rows,
        "dspark_vs_fixed_k5": {
            "verified_ratio": round(
                dspark["verified_draft_tokens_per_request_step"] / fixed["verified_draft_tokens_per_request_step"], 3
            ),
            "accepted_length_ratio": round(dspark["accepted_length"] / fixed["accepted_length"], 3),
            "throughput_ratio": round(dspark["output_tokens_per_s"] / fixed["output_tokens_per_s"], 3),
        },
        "dspark_vs_none_throughput_ratio": round(dspark["output_tokens_per_s"] / none["output_tokens_per_s"], 3),
    }


def targets(results: list[dict]) -> list[dict[str, object]]:
    """DeepSeek's table, row by row, met or missed; a row whose concurrency was not run is left out."""
    by_concurrency = {r["concurrency"]: r for r in results}
    rows = []
    for r in results:
        ratios = r["dspark_vs_fixed_k5"]
        rows += [
            {
                "what": f"verified tokens per step at concurrency {r['concurrency']}",
                "target": f"<= {TARGETS['verified_ratio_max']}x fixed K=5",
                "value": ratios["verified_ratio"],
                "met": ratios["verified_ratio"] <= TARGETS["verified_ratio_max"],
            },
            {
                "what": f"mean accepted length at concurrency {r['concurrency']}",
                "target": f">= {TARGETS['accepted_length_ratio_min']}x fixed K=5",
                "value": ratios["accepted_length_ratio"],
                "met": ratios["accepted_length_ratio"] >= TARGETS["accepted_length_ratio_min"],
            },
            {
                "what": f"throughput against no speculation at concurrency {r['concurrency']}",
                "target": f">= {TARGETS['throughput_vs_none_min']}x",
                "value": r["dspark_vs_none_throughput_ratio"],
                "met": r["dspark_vs_none_throughput_ratio"] >= TARGETS["throughput_vs_none_min"],
            },
        ]
    if 64 in by_concurrency:
        ratio = by_concurrency[64]["dspark_vs_fixed_k5"]["throughput_ratio"]
        rows.append(
            {
                "what": "throughput at concurrency 64",
                "target": f">= {TARGETS['throughput_ratio_at_64_min']}x fixed K=5",
                "value": ratio,
                "met": ratio >= TARGETS["throughput_ratio_at_64_min"],
            }
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cost-model", type=Path, default=Path("bench/results/cost_model_h200.json"))
    parser.add_argument("--per-token-scale", type=float, default=1.0, help="what-if: multiply the fit's b by this")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 96, 200])
    parser.add_argument("--steps", type=int, default=600, help="verify steps per policy and concurrency")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench/results/spec_budget_synthetic_h200_fit.json"))
    parser.add_argument("--quick", action="store_true", help="concurrency 1 and 16, 40 steps: for tests")
    args = parser.parse_args(argv)
    if args.steps < 1 or any(c < 1 for c in args.concurrency):
        parser.error("--steps and every --concurrency must be >= 1")
    if not args.per_token_scale > 0:
        parser.error("--per-token-scale must be positive")
    concurrency, steps = ([1, 16], 40) if args.quick else (args.concurrency, args.steps)
    model = PrefillCostModel.load(args.cost_model)
    if model.decode is None:
        parser.error(f"{args.cost_model} has no decode fit (bench.fit_cost_model measures one on a GPU)")
    model = replace(model, decode=replace(model.decode, b=model.decode.b * args.per_token_scale))
    results = [compare(c, model, steps, args.seed) for c in concurrency]
    result = {
        "benchmark": "spec_budget",
        "acceptance": "SYNTHETIC: drafts and their outcomes are generated (see the module docstring), not measured",
        "step_time": {
            "cost_model": str(args.cost_model),
            "per_token_scale": args.per_token_scale,
            "measured_curve": args.per_token_scale == 1.0,
            "decode": {name: getattr(model.decode, name) for name in ("a", "b", "e")},
        },
        "max_draft_tokens": K,
        "steps_per_policy": steps,
        "seed": args.seed,
        "results": results,
        "targets": targets(results),
    }
    text = json.dumps(result, indent=1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
