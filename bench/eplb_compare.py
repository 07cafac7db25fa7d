"""Our EPLB against the no-redundancy contiguous placement and a peer re-implementation of
DeepSeek's published EPLB algorithm (bench/eplb_deepseek_peer.py), on several generated loads.

    python -m bench.eplb_compare [--out bench/results/eplb_cpu.json] [--repeats 2] [--quick]

Every load (bench/eplb_loads.py) is placed from scratch by ours and by the peer on its base window;
on its drift window ours re-places from its own base placement (migration-aware), and ours and the
peer also place from scratch there, their slots changed counted against their own base placements.
Seconds are wall time, best of --repeats, with CPU seconds of the same run beside them (this
machine is shared); the peer runs in the same process right after ours. Prints the JSON and writes
it to --out.
"""

import argparse
import json
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from bench.eplb_deepseek_peer import deepseek_placement
from bench.eplb_loads import LoadsConfig, make_loads
from workers.eplb import layer_balance, place_experts, rebalance_experts, slots_changed

BASE = LoadsConfig()
CASES = [
    ("zipf1.0_seed0", BASE, 1),
    ("zipf1.0_seed1", replace(BASE, seed=1), 1),
    ("zipf1.0_seed2", replace(BASE, seed=2), 1),
    ("zipf0.8_noise1.0_seed3", replace(BASE, seed=3, skew=0.8, noise=1.0), 1),
    ("zipf1.2_seed4", replace(BASE, seed=4, skew=1.2), 1),
    ("zipf1.0_drift0.4_seed5", replace(BASE, seed=5, drift=0.4), 1),
    ("zipf1.0_seed6_nodes4", replace(BASE, seed=6), 4),
    ("zipf0.6_seed7_nodes8", replace(BASE, seed=7, skew=0.6), 8),
    ("qwen3_48x128_32gpus_160slots_seed8", replace(BASE, seed=8, layers=48, experts=128, gpus=32, slots=160), 1),
    ("v3_61x256_32gpus_288slots_seed9", replace(BASE, seed=9, layers=61, gpus=32, slots=288), 1),
]
QUICK_CASES = [("quick_12x64_8gpus_80slots", replace(BASE, layers=12, experts=64, gpus=8, slots=80), 1)]


def timed(place, repeats: int):
    """The result of the fastest of `repeats` calls, its wall and CPU seconds."""
    best = None
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        result = np.asarray(place())
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        if best is None or wall < best[1]:
            best = (result, wall, cpu)
    return best


def scored(placement: np.ndarray, loads: np.ndarray, wall: float | None = None, cpu: float | None = None, **extra):
    balance = layer_balance(placement, loads)
    row = {"max_over_mean": round(float(balance.mean()), 5), "worst_layer": round(float(balance.max()), 5)}
    if wall is not None:
        row |= {"seconds": round(wall, 4), "cpu_seconds": round(cpu, 4)}
    return row | extra


def changed(previous: np.ndarray, placement: np.ndarray) -> float:
    return round(slots_changed(previous, placement), 4)


def contiguous(layers: int, experts: int, gpus: int) -> np.ndarray:
    """No redundancy: experts/gpus consecutive experts per GPU, the same in every layer."""
    return np.broadcast_to(np.arange(experts).reshape(gpus, -1), (layers, gpus, experts // gpus))


def compare_case(name: str, config: LoadsConfig, nodes: int, repeats: int) -> dict:
    data = make_loads(config)
    base, drift = np.asarray(data["base"]), np.asarray(data["drift"])
    sizes = {"gpus": config.gpus, "slots": config.slots, "nodes": nodes}
    ours, ours_wall, ours_cpu = timed(lambda: place_experts(base, **sizes), repeats)
    peer, peer_wall, peer_cpu = timed(lambda: deepseek_placement(base, **sizes), repeats)
    moved, moved_wall, moved_cpu = timed(lambda: rebalance_experts(drift, ours, **sizes), repeats)
    ours_drift = place_experts(drift, **sizes)
    peer_drift = np.asarray(deepseek_placement(drift, **sizes))
    return {
        "name": name,
        "loads": asdict(config) | {"nodes": nodes},
        "base": {
            "ours": scored(ours, base, ours_wall, ours_cpu),
            "deepseek_eplb_reimplementation": scored(peer, base, peer_wall, peer_cpu),
            "contiguous_no_redundancy": scored(contiguous(config.layers, config.experts, config.gpus), base),
            "speedup_wall": round(peer_wall / ours_wall, 2),
            "speedup_cpu": round(peer_cpu / ours_cpu, 2),
        },
        "drift": {
            "ours_migration_aware": scored(moved, drift, moved_wall, moved_cpu, slots_changed=changed(ours, moved)),
            "ours_base_placement_kept": scored(ours, drift, slots_changed=0.0),
            "ours_from_scratch": scored(ours_drift, drift, slots_changed=changed(ours, ours_drift)),
            "deepseek_from_scratch": scored(peer_drift, drift, slots_changed=changed(peer, peer_drift)),
        },
    }


def summary(cases: list[dict]) -> dict:
    flat = [case for case in cases if case["loads"]["nodes"] == 1]
    better = [
        c["base"]["ours"]["max_over_mean"] <= c["base"]["deepseek_eplb_reimplementation"]["max_over_mean"]
        for c in cases
    ]
    return {
        "ours_max_over_mean_le_deepseek_in": f"{sum(better)}/{len(cases)}",
        "min_speedup_wall": min(c["base"]["speedup_wall"] for c in cases),
        "min_speedup_cpu": min(c["base"]["speedup_cpu"] for c in cases),
        "drift_flat_max_slots_changed": max(c["drift"]["ours_migration_aware"]["slots_changed"] for c in flat),
        "drift_flat_max_max_over_mean": max(c["drift"]["ours_migration_aware"]["max_over_mean"] for c in flat),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/eplb_cpu.json"))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="one small load, for tests")
    args = parser.parse_args(argv)
    cases = [
        compare_case(name, config, nodes, args.repeats)
        for name, config, nodes in (QUICK_CASES if args.quick else CASES)
    ]
    result = {"cases": cases, "summary": summary(cases)}
    text = json.dumps(result, indent=1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
