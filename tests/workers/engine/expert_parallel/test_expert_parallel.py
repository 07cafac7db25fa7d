"""ExpertParallelExperts over 2 and 4 gloo ranks in spawned processes equals the single-process experts
(fp32 tolerance), with and without redundant experts, with a rank that has no tokens; the load
counters count every routed pair at the slot it went to. A new placement staged within the group
moves the weights between the ranks (the host copies are wiped first, so they cannot be the source)."""

import pytest
import torch

from kernels.moe import experts
from tests.workers.engine.expert_parallel.spawned import run_on_ranks
from workers.engine.parallel.experts import ExpertParallelExperts
from workers.engine.parallel.groups import EPGroup
from workers.engine.parallel.placement import round_robin_placement

EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 8, 16, 8, 3


def _weights() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    w13 = torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=generator) * 0.2
    w2 = torch.randn(EXPERTS, HIDDEN, INTERMEDIATE, generator=generator) * 0.2
    return w13, w2


def _batch(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, HIDDEN, generator=generator)
    scores = torch.randn(tokens, EXPERTS, generator=generator).softmax(dim=-1)
    weights, ids = scores.topk(TOP_K, dim=-1)
    return hidden, ids, weights


def check_scenarios(group: EPGroup, scenarios: list[tuple[list[list[int]], list[int]]]) -> list[dict]:
    """Per scenario (placement [rank][slot], tokens per rank): this rank's largest difference from
    the single-process result, and its load counts."""
    w13, w2 = _weights()
    found = []
    for number, (placement, tokens_per_rank) in enumerate(scenarios):
        layer = ExpertParallelExperts(
            group=group, host_w13=w13, host_w2=w2, placement=placement, top_k=TOP_K, compute=experts
        )
        hidden, ids, weights = _batch(sum(tokens_per_rank), seed=number)
        start = sum(tokens_per_rank[: group.rank])
        mine = slice(start, start + tokens_per_rank[group.rank])
        expected = experts(hidden, w13, w2, ids, weights)[mine]
        got = layer(hidden[mine], ids[mine], weights[mine])
        found.append(
            {
                "error": (got - expected).abs().max().item() if got.numel() else 0.0,
                "shape": tuple(got.shape),
                "load": layer.take_load().tolist(),
            }
        )
    return found


def _replicated(ranks: int, slots: int) -> list[list[int]]:
    return round_robin_placement(num_layers=1, num_experts=EXPERTS, num_ranks=ranks, slots_per_rank=slots)[0]


@pytest.mark.parametrize(
    ("ranks", "scenarios"),
    [
        (2, [(_replicated(2, 4), [5, 7]), (_replicated(2, 6), [6, 0]), ([[7, 6, 5, 4], [3, 2, 1, 0]], [1, 9])]),
        (4, [(_replicated(4, 2), [4, 0, 3, 6]), (_replicated(4, 3), [5, 2, 0, 7])]),
    ],
)
def test_expert_parallel_equals_one_process(ranks, scenarios):
    results = run_on_ranks(check_scenarios, ranks, scenarios)
    for number, (placement, tokens_per_rank) in enumerate(scenarios):
        per_rank = [results[rank][number] for rank in range(ranks)]
        for rank, found in enumerate(per_rank):
            assert found["shape"] == (tokens_per_rank[rank], HIDDEN)
            assert found["error"] < 1e-5, (number, rank, found["error"])
        load = torch.tensor([found["load"] for found in per_rank]).sum(dim=0)
        assert load.sum().item() == sum(tokens_per_rank) * TOP_K
        # Every pair counted at a slot holding its expert; a replicated expert's load is spread.
        slots = [expert for rank in placement for expert in rank]
        _, ids, _ = _batch(sum(tokens_per_rank), seed=number)
        per_expert = torch.bincount(ids.reshape(-1), minlength=EXPERTS)
        for expert in range(EXPERTS):
            replicas = [i for i, e in enumerate(slots) if e == expert]
            assert load[replicas].sum().item() == per_expert[expert].item()
            if len(replicas) > 1 and per_expert[expert] > 1:
                assert all(load[slot] > 0 for slot in replicas), (expert, load[replicas])


def check_moved(group: EPGroup, old: list[list[int]], new: list[list[int]]) -> float:
    """Stage `new` over `old` with the host copies zeroed; this rank's largest difference afterwards."""
    w13, w2 = _weights()
    layer = ExpertParallelExperts(
        group=group, host_w13=w13.clone(), host_w2=w2.clone(), placement=old, top_k=TOP_K, compute=experts
    )
    layer.host_w13.zero_()
    layer.host_w2.zero_()
    layer.install(layer.stage(group, new))
    hidden, ids, weights = _batch(20, seed=5)
    mine = slice(10 * group.rank, 10 * group.rank + 10)
    expected = experts(hidden, w13, w2, ids, weights)[mine]
    return (layer(hidden[mine], ids[mine], weights[mine]) - expected).abs().max().item()


def test_a_new_placement_moves_weights_between_the_ranks():
    old = [[0, 1, 2, 3, 4], [5, 6, 7, 0, 1]]
    new = [[7, 6, 5, 7, 0], [2, 3, 4, 1, 2]]  # all but one slot filled from the other rank
    assert max(run_on_ranks(check_moved, 2, old, new)) < 1e-5
