"""Running a function on every rank of a gloo group of spawned processes, for the EP tests."""

import multiprocessing
import traceback
from collections.abc import Callable
from typing import Any

import torch

from workers.engine.parallel.groups import Rendezvous, join_group

# From a fork server, not forked from the test process (its OpenMP and gloo threads' state would be
# copied): the server imports torch once for all the ranks it starts.
CONTEXT = multiprocessing.get_context("forkserver")
CONTEXT.set_forkserver_preload(["torch", "kernels.moe", "workers.engine.parallel.experts"])
RANK_TIMEOUT_S = 120


def _run_rank(function: Callable, rank: int, size: int, port: int, args: tuple, results: Any) -> None:
    try:
        torch.set_num_threads(1)
        group = join_group(rank=rank, size=size, port=port, device=torch.device("cpu"))
        results.put((rank, function(group, *args), None))
    except BaseException:
        results.put((rank, None, traceback.format_exc()))


def run_on_ranks(function: Callable, size: int, *args: Any) -> list[Any]:
    """`function(group, *args)` on ranks 1.. in spawned processes and rank 0 here; its results by rank."""
    rendezvous = Rendezvous.open(size)
    results = CONTEXT.Queue()
    processes = [
        CONTEXT.Process(target=_run_rank, args=(function, rank, size, rendezvous.port, args, results), daemon=True)
        for rank in range(1, size)
    ]
    for process in processes:
        process.start()
    group = join_group(rank=0, size=size, port=rendezvous.port, device=torch.device("cpu"), rendezvous=rendezvous)
    try:
        by_rank = {0: function(group, *args)}
        for _ in processes:
            rank, result, error = results.get(timeout=RANK_TIMEOUT_S)
            assert error is None, f"rank {rank} failed:\n{error}"
            by_rank[rank] = result
    finally:
        group.destroy()
        for process in processes:
            process.join(timeout=RANK_TIMEOUT_S)
    return [by_rank[rank] for rank in range(size)]
