"""Expert placements and the routing tables built from them.

A placement is `placement[layer][rank][slot] -> logical expert id`: every rank has the same number of
slots, and every logical expert has at least one slot in every layer (hot experts several: its
replicas). Physical slot `rank * slots_per_rank + slot` is how counters and tables index a slot.

A token routed to a replicated expert goes to replica `token_index % num_replicas` of it: the load
spreads over the replicas, and the choice depends only on the batch, so it is deterministic.
"""

from dataclasses import dataclass

import torch

Placement = list[list[list[int]]]


class PlacementError(ValueError):
    """A placement that cannot be put in force; the message says what is wrong with it."""


def placement_error(placement: object, *, num_layers: int, num_experts: int, num_ranks: int) -> str:
    """Why `placement` is not a placement of `num_experts` experts over `num_ranks` ranks for
    `num_layers` MoE layers, or "" when it is one."""
    if not isinstance(placement, list) or len(placement) != num_layers:
        return f"the placement must have {num_layers} layers, got {_length(placement)}"
    slots = None
    for layer, ranks in enumerate(placement):
        if not isinstance(ranks, list) or len(ranks) != num_ranks:
            return f"layer {layer} must have {num_ranks} ranks, got {_length(ranks)}"
        for rank, experts in enumerate(ranks):
            if not isinstance(experts, list) or not experts:
                return f"layer {layer} rank {rank} must be a non-empty list of expert ids"
            if slots is None:
                slots = len(experts)
            if len(experts) != slots:
                return f"layer {layer} rank {rank} has {len(experts)} slots; every rank has {slots}"
            if any(not isinstance(e, int) or isinstance(e, bool) or not 0 <= e < num_experts for e in experts):
                return f"layer {layer} rank {rank} names experts outside 0..{num_experts - 1}"
        missing = sorted(set(range(num_experts)) - {e for experts in ranks for e in experts})
        if missing:
            return f"layer {layer}: experts {missing[:8]} have no slot on any rank"
    return ""


def check_placement(placement: object, *, num_layers: int, num_experts: int, num_ranks: int) -> Placement:
    if error := placement_error(placement, num_layers=num_layers, num_experts=num_experts, num_ranks=num_ranks):
        raise PlacementError(error)
    return placement


def round_robin_placement(*, num_layers: int, num_experts: int, num_ranks: int, slots_per_rank: int) -> Placement:
    """Every expert once, in order, then the first experts again to fill the spare slots: the
    placement an engine starts with, and the one survivors take after a rank dies."""
    if slots_per_rank * num_ranks < num_experts:
        raise PlacementError(f"{num_ranks} ranks x {slots_per_rank} slots cannot hold {num_experts} experts")
    flat = [i % num_experts for i in range(num_ranks * slots_per_rank)]
    layer = [flat[r * slots_per_rank : (r + 1) * slots_per_rank] for r in range(num_ranks)]
    return [[list(rank) for rank in layer] for _ in range(num_layers)]


def slots_for(num_experts: int, num_ranks: int, redundant_experts: int = 0) -> int:
    """Slots per rank that hold every expert once plus `redundant_experts` replicas, rounded up."""
    return -(-(num_experts + redundant_experts) // num_ranks)


@dataclass(frozen=True, slots=True)
class RoutingTable:
    """One layer's placement as tensors on the device: logical expert -> its physical slots."""

    replicas: torch.Tensor  # int64 [experts, max replicas]: physical slots, padded with the first
    num_replicas: torch.Tensor  # int64 [experts]
    slots_per_rank: int

    @classmethod
    def build(cls, layer: list[list[int]], num_experts: int, device: torch.device) -> "RoutingTable":
        slots_per_rank = len(layer[0])
        replicas: list[list[int]] = [[] for _ in range(num_experts)]
        for rank, experts in enumerate(layer):
            for slot, expert in enumerate(experts):
                replicas[expert].append(rank * slots_per_rank + slot)
        width = max(len(r) for r in replicas)
        padded = [r + [r[0]] * (width - len(r)) for r in replicas]
        return cls(
            replicas=torch.tensor(padded, dtype=torch.int64, device=device),
            num_replicas=torch.tensor([len(r) for r in replicas], dtype=torch.int64, device=device),
            slots_per_rank=slots_per_rank,
        )

    def physical_slots(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """[T, k] logical ids -> [T, k] physical slots, replica chosen by token index."""
        tokens = torch.arange(topk_ids.shape[0], device=topk_ids.device).unsqueeze(1)
        choice = tokens % self.num_replicas[topk_ids]
        return self.replicas[topk_ids, choice]


def _length(value: object) -> str:
    return str(len(value)) if isinstance(value, list) else type(value).__name__
