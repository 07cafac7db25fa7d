"""Development loads for the EPLB: Zipf expert popularity with per-layer log-normal noise, and a
drifted later window of the same workload.

    python -m bench.eplb_loads --out var/eplb_loads.json [--seed 0] [--skew 1.0] [--noise 0.5]
        [--drift 0.25] [--layers 58] [--experts 256] [--gpus 64] [--slots 320] [--tokens 65536]
        [--top-k 8]

Each layer ranks its experts in its own random order (each layer has its own router); the expert of
rank r has popularity r^-skew times a log-normal factor exp(N(0, noise)). The base window routes
tokens x top-k assignments by those popularities (multinomial); the drift window multiplies every
popularity by another log-normal factor exp(N(0, drift)) and draws again.
"""

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class LoadsConfig:
    seed: int = 0
    skew: float = 1.0
    noise: float = 0.5
    drift: float = 0.25
    layers: int = 58
    experts: int = 256
    gpus: int = 64
    slots: int = 320
    tokens: int = 65536
    top_k: int = 8


def make_loads(config: LoadsConfig) -> dict:
    """The loads file's content: sizes, and the base and drift windows [layers][experts]."""
    rng = np.random.default_rng(config.seed)
    ranks = np.argsort(rng.random((config.layers, config.experts)), axis=1) + 1
    popularity = ranks.astype(np.float64) ** -config.skew * rng.lognormal(0.0, config.noise, ranks.shape)
    drifted = popularity * rng.lognormal(0.0, config.drift, ranks.shape)
    assignments = config.tokens * config.top_k
    return {
        "layers": config.layers,
        "experts": config.experts,
        "gpus": config.gpus,
        "slots": config.slots,
        "base": _route(rng, popularity, assignments),
        "drift": _route(rng, drifted, assignments),
    }


def _route(rng: np.random.Generator, popularity: np.ndarray, assignments: int) -> list[list[int]]:
    return [rng.multinomial(assignments, row / row.sum()).tolist() for row in popularity]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    defaults = LoadsConfig()
    for name, value in vars(defaults).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    args = parser.parse_args(argv)
    config = LoadsConfig(**{name: getattr(args, name) for name in vars(defaults)})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(make_loads(config)))


if __name__ == "__main__":
    main()
