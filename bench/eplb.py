"""The EPLB on a loads file: one placement, its balance, how long it took and how many slots moved.

    python -m bench.eplb --loads FILE --which base|drift --gpus G --slots S [--nodes N]
        [--previous-placement FILE] [--save-placement FILE] [--target-balance 1.025]

Prints one JSON line {"max_over_mean", "worst_layer", "seconds", "slots_changed"}: max_over_mean
is, per layer, the max over GPUs of GPU load over the mean (each expert's load split evenly over its
replicas), averaged over layers; worst_layer the largest of those; seconds the wall time of the
placement alone (files not counted); slots_changed the fraction of slots whose expert differs from
--previous-placement, null without one. With --previous-placement the migration-aware mode starts
from it. Loads file: {"layers", "experts", "gpus", "slots", "base": [[int] * E] * L, "drift": ...};
a placement file is the JSON list placement[layer][gpu][slot]. Bad input exits 2 with the reason.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from workers.eplb import PlacementInputError, layer_balance, place_experts, rebalance_experts, slots_changed
from workers.eplb.placement import DEFAULT_TARGET_BALANCE


def run(args: argparse.Namespace) -> dict:
    loads = _read_json(args.loads, "--loads")
    if not isinstance(loads, dict) or args.which not in loads:
        raise PlacementInputError(f"--loads {args.loads} has no {args.which!r} window")
    window = loads[args.which]
    previous = _read_json(args.previous_placement, "--previous-placement") if args.previous_placement else None
    started = time.perf_counter()
    if previous is None:
        placement = place_experts(window, gpus=args.gpus, slots=args.slots, nodes=args.nodes)
    else:
        placement = rebalance_experts(
            window, previous, gpus=args.gpus, slots=args.slots, nodes=args.nodes, target_balance=args.target_balance
        )
    seconds = time.perf_counter() - started
    balance = layer_balance(placement, np.asarray(window))
    if args.save_placement:
        args.save_placement.write_text(json.dumps(placement.tolist()))
    return {
        "max_over_mean": round(float(balance.mean()), 6),
        "worst_layer": round(float(balance.max()), 6),
        "seconds": round(seconds, 6),
        "slots_changed": None if previous is None else round(slots_changed(previous, placement), 6),
    }


def _read_json(path: Path, flag: str):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise PlacementInputError(f"{flag} {path}: {error}") from None


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loads", type=Path, required=True)
    parser.add_argument("--which", choices=["base", "drift"], required=True)
    parser.add_argument("--gpus", type=int, required=True)
    parser.add_argument("--slots", type=int, required=True)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--previous-placement", type=Path)
    parser.add_argument("--save-placement", type=Path)
    parser.add_argument("--target-balance", type=float, default=DEFAULT_TARGET_BALANCE)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    try:
        result = run(args)
    except PlacementInputError as error:
        print(f"bench.eplb: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    print(json.dumps(result))


if __name__ == "__main__":
    main()
