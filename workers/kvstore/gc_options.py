"""The store GC's settings, defined once for both places a GC runs: a thread of an engine worker
(workers.worker.args, `--kv-gc-interval` > 0) and the store's own GC process
(workers.kvstore.gc_process, `manage.py run_kv_gc`). Run one GC per store: two on one shared index
would each evict for the same excess, and GCs on separate indexes would each see part of the store."""

import argparse

from workers.kvstore.eviction import POLICIES

GC_INTERVAL_S = 10.0
CAPACITY_BYTES = 8 << 30
EVICTION_POLICY = "best"
CAPACITY_HELP = "bytes the store may hold: the GC evicts from its high watermark down to its low one, fractions of this"
EVICTION_POLICY_HELP = "which blocks the GC evicts first"


def add_gc_arguments(parser: argparse.ArgumentParser, *, interval_help: str) -> None:
    parser.add_argument("--kv-gc-interval", type=float, default=GC_INTERVAL_S, help=interval_help)
    parser.add_argument(
        "--kv-store-capacity-bytes",
        type=int,
        default=CAPACITY_BYTES,
        help=f"{CAPACITY_HELP} (default: %(default)s)",
    )
    parser.add_argument(
        "--kv-eviction-policy",
        default=EVICTION_POLICY,
        choices=sorted(POLICIES),
        help=f"{EVICTION_POLICY_HELP} (default: %(default)s)",
    )
