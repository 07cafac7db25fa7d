"""Eviction policies on generated multi-turn traces: `bench.trace_replay`'s comparison on each of
several shapes and seeds of `bench.multiturn_trace`, with a tally of where `best` beats every classic.

    python -m bench.trace_replay_generated [--policies lru,slru,gdsf,lru_logfreq,best] [--traces chat-0,...]

Each trace is written to a temporary directory and replayed by `bench.trace_replay.run_all` (the
store's own index, GC and policies, Belady and the infinite cache beside them) at 5% and 10% of its
unique blocks. Prints one JSON object: per trace its generator settings and the comparison, then
`summary`: for each (trace, capacity) pair the margin of `best` over the best classic (its hit rate
minus theirs), and how many pairs `best` wins.

The traces vary what the study of reuse (workers.kvstore.eviction) found to matter: the presets
(chat, agent, docs, api) on two seeds each, plus slow chat (think times of minutes, heavy tailed),
many weakly shared system prompts with one-off questions under them, and long agent chains; and two
seeds of `bench.skewed_trace` (Zipf-popular prefixes, a unique tail per request), the traffic the
segmented LRU was built for.
"""

import argparse
import json
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

from bench import multiturn_trace, skewed_trace
from bench.multiturn_trace import SHAPES, MultiTurnConfig
from bench.skewed_trace import SkewedTraceConfig
from bench.trace_replay import TRACE_BLOCK_TOKENS, run_all

CLASSICS = ("lru", "slru", "gdsf", "lru_logfreq")

PRESETS = {
    f"{shape}-{seed}": replace(SHAPES[shape], seed=seed)
    for shape in ("chat", "agent", "docs", "api")
    for seed in (0, 1)
}
TRACES: dict[str, MultiTurnConfig | SkewedTraceConfig] = {
    **PRESETS,
    "slow-chat-2": replace(SHAPES["chat"], seed=2, sessions=1500, session_rate=1.0, think_s=300.0, think_sigma=2.0),
    "many-prompts-3": replace(
        SHAPES["chat"], seed=3, system_prompts=50, system_zipf=0.5, one_off_share=0.3, one_off_shared_share=0.5
    ),
    "long-agent-4": replace(
        SHAPES["agent"], seed=4, continue_prob=0.97, max_turns=100, think_s=10.0, think_sigma=1.8
    ),
    "skewed-0": SkewedTraceConfig(seed=0),
    "skewed-1": SkewedTraceConfig(seed=1),
}  # fmt: skip


def compare(names: list[str], policies: list[str], shares: list[float]) -> dict[str, object]:
    unknown = [name for name in names if name not in TRACES]
    if unknown:
        raise ValueError(f"unknown traces {unknown}; choose from {', '.join(TRACES)}")
    results = {}
    with tempfile.TemporaryDirectory() as directory:
        for name in names:
            path = Path(directory) / f"{name}.jsonl"
            config = TRACES[name]
            generator = multiturn_trace if isinstance(config, MultiTurnConfig) else skewed_trace
            generator.write_trace(path, config)
            results[name] = {
                "generator": generator.__name__,
                "config": asdict(config),
                **run_all(path, policies, shares, TRACE_BLOCK_TOKENS),
            }
    return {"traces": results, "summary": summarize(results, policies)}


def summarize(results: dict[str, dict], policies: list[str]) -> dict[str, object]:
    """Per (trace, share): best's hit rate minus the best classic's among `policies`, and the wins."""
    classics = [name for name in policies if name in CLASSICS]
    if "best" not in policies or not classics:
        return {}
    margins = {}
    for name, result in results.items():
        for capacity in result["capacities"]:
            rates = capacity["policies"]
            runner_up = max(classics, key=lambda classic: rates[classic]["hit_rate"])
            margins[f"{name}@{capacity['share']}"] = {
                "best_minus_best_classic": rates["best"]["hit_rate"] - rates[runner_up]["hit_rate"],
                "best_classic": runner_up,
            }
    wins = sum(margin["best_minus_best_classic"] > 0 for margin in margins.values())
    return {"classics": classics, "best_beats_every_classic": f"{wins} of {len(margins)}", "margins": margins}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default="lru,slru,gdsf,lru_logfreq,best", help="comma-separated policy names")
    parser.add_argument("--traces", default=",".join(TRACES), help=f"comma-separated, from: {', '.join(TRACES)}")
    parser.add_argument("--capacity-shares", default="0.05,0.1", help="shares of each trace's unique blocks")
    args = parser.parse_args()
    try:
        shares = [float(share) for share in args.capacity_shares.split(",")]
        result = compare(args.traces.split(","), args.policies.split(","), shares)
    except ValueError as error:
        parser.error(str(error))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
