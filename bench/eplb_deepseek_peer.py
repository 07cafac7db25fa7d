"""Peer for bench.eplb_compare: our re-implementation, written from reading it, of the algorithm
DeepSeek published as EPLB (github.com/deepseek-ai/EPLB, `eplb.py`). Not their code.

Their algorithm, step by step (torch on the CPU, as they run it):
1. Hierarchical when the expert groups divide evenly over nodes: pack groups onto nodes (greedy,
   equal group count per node); within each node, add replicas one at a time to the expert with the
   highest load per replica; pack the node's replicas onto its GPUs with the same greedy packing.
2. Otherwise global: the same with one group and one node.
The greedy packing walks the items heaviest first, each into the lightest pack that still has room,
one layer after another in Python. Our one liberty: the weights are read through `tolist()` rather
than indexed tensor by tensor, which only makes the peer faster than theirs.
"""

import torch


def balanced_packing(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Items [layers][n] into num_packs packs of n/num_packs items: pack index and rank in pack."""
    layers, items = weight.shape
    per_pack = items // num_packs
    if per_pack == 1:
        index = torch.arange(items, dtype=torch.int64).expand(layers, items).clone()
        return index, torch.zeros_like(index)
    order = weight.float().sort(-1, descending=True).indices.tolist()
    values = weight.tolist()
    pack_index = torch.full((layers, items), -1, dtype=torch.int64)
    rank_in_pack = torch.full_like(pack_index, -1)
    for layer in range(layers):
        pack_weights = [0.0] * num_packs
        pack_items = [0] * num_packs
        for item in order[layer]:
            pack = min((p for p in range(num_packs) if pack_items[p] < per_pack), key=pack_weights.__getitem__)
            pack_index[layer, item] = pack
            rank_in_pack[layer, item] = pack_items[pack]
            pack_weights[pack] += values[layer][item]
            pack_items[pack] += 1
    return pack_index, rank_in_pack


def replicate_experts(weight: torch.Tensor, num_physical: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Physical -> logical map [layers][num_physical] and replica counts [layers][logical]."""
    layers, logical = weight.shape
    rows = torch.arange(layers)
    physical_to_logical = torch.arange(num_physical, dtype=torch.int64).repeat(layers, 1)
    counts = torch.ones(layers, logical, dtype=torch.int64)
    for physical in range(logical, num_physical):
        hottest = (weight / counts).max(dim=-1).indices
        physical_to_logical[:, physical] = hottest
        counts[rows, hottest] += 1
    return physical_to_logical, counts


def _inverse(permutation: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(permutation)
    inverse.scatter_(1, permutation, torch.arange(permutation.size(1), dtype=torch.int64).expand(permutation.shape))
    return inverse


def rebalance_hierarchical(
    weight: torch.Tensor, num_physical: int, num_groups: int, num_nodes: int, num_gpus: int
) -> torch.Tensor:
    """Physical slot -> logical expert [layers][num_physical], slots in GPU order."""
    layers, logical = weight.shape
    group_size = logical // num_groups
    groups_per_node = num_groups // num_nodes
    slots_per_gpu = num_physical // num_gpus
    group_loads = weight.unflatten(-1, (num_groups, group_size)).sum(-1)
    group_pack, group_rank = balanced_packing(group_loads, num_nodes)
    # Logical experts renumbered so that each node's come together ("middle" ids).
    logical_to_middle = (
        ((group_pack * groups_per_node + group_rank) * group_size).unsqueeze(-1) + torch.arange(group_size)
    ).flatten(-2)
    middle_to_logical = _inverse(logical_to_middle)
    middle_loads = weight.gather(-1, middle_to_logical).view(-1, logical // num_nodes)
    physical_to_middle, middle_counts = replicate_experts(middle_loads, num_physical // num_nodes)
    physical_loads = (middle_loads / middle_counts).gather(-1, physical_to_middle)
    pack, rank = balanced_packing(physical_loads, num_gpus // num_nodes)
    placed_to_physical = _inverse(pack * slots_per_gpu + rank)
    placed_to_middle = physical_to_middle.gather(-1, placed_to_physical)
    offsets = torch.arange(0, logical, logical // num_nodes).view(1, -1, 1)
    placed_to_middle = (placed_to_middle.view(layers, num_nodes, -1) + offsets).flatten(-2)
    return middle_to_logical.gather(-1, placed_to_middle)


def deepseek_placement(loads, *, gpus: int, slots: int, nodes: int = 1) -> torch.Tensor:
    """placement [layers][gpus][slots // gpus]. With nodes, every expert is its own group (their
    num_groups = experts), the finest grouping their hierarchical mode allows."""
    weight = torch.as_tensor(loads).float()
    layers, experts = weight.shape
    if nodes > 1:
        placed = rebalance_hierarchical(weight, slots, experts, nodes, gpus)
    else:
        placed = rebalance_hierarchical(weight, slots, 1, 1, gpus)
    return placed.view(layers, gpus, slots // gpus)
