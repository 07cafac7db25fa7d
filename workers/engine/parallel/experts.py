"""ExpertParallelExperts: a MoE layer's routed experts spread over the ranks of an EP group.

It takes RoutedExperts' place (same forward: hidden [T, H], topk_ids [T, k] logical ids,
topk_weights [T, k]) and returns the same [T, H]. Per call:
  1. logical id -> physical slot (RoutingTable: replica by token index) -> (rank, local slot);
  2. dispatch: each token's hidden row goes once to every rank holding one of its slots, with its
     local slots there (-1 for the others) and their weights;
  3. each rank runs the rows it received through its local slots (`compute`, kernels.moe.experts),
     which returns each row's weighted sum over the slots it holds;
  4. combine: the partial sums return to the token's rank, which adds them up (float32).
Each call also counts, on the device, the pairs this rank routed to every physical slot (`load`).

Weights: every rank keeps its own slots' weights on its device and the layer's full expert weights
in host memory (the checkpoint's copy, for a group re-formed after a rank died). A new placement is
staged first (weights moved between the ranks' devices, see transfer.py) and then swapped in with
the routing table in one assignment, so a forward sees the old one or the new one.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from workers.engine.parallel.dispatch import exchange_counts, exchange_rows
from workers.engine.parallel.groups import EPGroup
from workers.engine.parallel.placement import RoutingTable
from workers.engine.parallel.transfer import move_experts

# kernels.moe.experts' signature: hidden [T, H], w13 [S, 2I, H], w2 [S, H, I], topk_slots int64
# [T, k] (-1: not here), topk_weights f32 [T, k] -> [T, H].
ExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class StagedLayer:
    """What a placement puts in force for one layer, built before anything changes."""

    group: EPGroup
    table: RoutingTable
    w13: torch.Tensor
    w2: torch.Tensor
    placement: list[list[int]]  # every rank's slots, by logical id


class ExpertParallelExperts(nn.Module):
    def __init__(
        self,
        *,
        group: EPGroup,
        host_w13: torch.Tensor,
        host_w2: torch.Tensor,
        placement: list[list[int]],
        top_k: int,
        compute: ExpertsFn,
    ) -> None:
        super().__init__()
        self.num_experts = host_w13.shape[0]
        self.top_k = top_k  # every rank's rows carry k slots, an empty pass's too
        self.host_w13 = host_w13.detach().cpu()
        self.host_w2 = host_w2.detach().cpu()
        self.compute = compute
        self.num_calls = 0  # forwards so far: the EP engine's check that a step joined every layer
        self._install(self._stage_from_host(group, placement))

    def stage(self, group: EPGroup, placement: list[list[int]]) -> StagedLayer:
        """This layer's part of a placement ([rank][slot]) for `group`; nothing in force changes.
        Within the group in force the weights move between the ranks' devices (a collective: every
        rank stages the same placement together); for a group re-formed after a rank died, whose
        experts only host memory may still have, they come from the host copy."""
        if group is not self.group:
            return self._stage_from_host(group, placement)
        w13, w2 = move_experts(group, self.placement, placement, [self.w13, self.w2])
        return self._staged(group, placement, w13, w2)

    def _stage_from_host(self, group: EPGroup, placement: list[list[int]]) -> StagedLayer:
        index = torch.tensor(placement[group.rank], dtype=torch.int64)
        return self._staged(
            group, placement, self.host_w13[index].to(group.device), self.host_w2[index].to(group.device)
        )

    def _staged(self, group: EPGroup, placement: list[list[int]], w13: torch.Tensor, w2: torch.Tensor) -> StagedLayer:
        table = RoutingTable.build(placement, self.num_experts, group.device)
        return StagedLayer(group=group, table=table, w13=w13, w2=w2, placement=[list(r) for r in placement])

    def install(self, staged: StagedLayer) -> None:
        """Put a staged placement in force. The load counts restart: they index the new slots."""
        self._install(staged)

    def _install(self, staged: StagedLayer) -> None:
        self.group = staged.group
        self.table = staged.table
        self.w13, self.w2 = staged.w13, staged.w2
        self.placement = staged.placement
        self.slots_per_rank = staged.table.slots_per_rank
        self.load = torch.zeros(staged.group.size * self.slots_per_rank, dtype=torch.int64, device=staged.group.device)

    def take_load(self) -> torch.Tensor:
        """Pairs routed to each physical slot since the last take (this rank's tokens), on the device."""
        load, self.load = self.load, torch.zeros_like(self.load)
        return load

    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        self.num_calls += 1
        tokens, k = topk_ids.shape
        physical = self.table.physical_slots(topk_ids).reshape(-1)
        self.load += torch.bincount(physical, minlength=self.load.shape[0])
        group = self.group
        if group.process_group is None:
            return self.compute(hidden, self.w13, self.w2, physical.view(tokens, k), topk_weights)
        # One row per (token, destination rank): a token with several experts on a rank goes there
        # once, with its slots there (-1 for the others) and weights; the rank returns their weighted sum.
        physical = physical.view(tokens, k)
        destination = physical // self.slots_per_rank
        token_index = torch.arange(tokens, device=hidden.device).unsqueeze(1).expand(tokens, k)
        keys = destination * tokens + token_index  # rows grouped by destination, tokens in order
        row_keys, row_of_pair = torch.unique(keys, return_inverse=True)
        send_slots = torch.full((row_keys.shape[0], k), -1, dtype=torch.int64, device=hidden.device)
        send_weights = torch.zeros((row_keys.shape[0], k), dtype=torch.float32, device=hidden.device)
        choice = torch.arange(k, device=hidden.device).expand(tokens, k)
        send_slots[row_of_pair, choice] = physical % self.slots_per_rank
        send_weights[row_of_pair, choice] = topk_weights.float()
        row_tokens = row_keys % tokens if tokens else row_keys
        send_counts = torch.bincount(row_keys // max(tokens, 1), minlength=group.size)
        send = send_counts.tolist()
        recv = exchange_counts(group, send_counts).tolist()
        rows = exchange_rows(group, hidden[row_tokens], send_counts=send, recv_counts=recv)
        slots = exchange_rows(group, send_slots, send_counts=send, recv_counts=recv)
        weights = exchange_rows(group, send_weights, send_counts=send, recv_counts=recv)
        computed = self.compute(rows, self.w13, self.w2, slots, weights) if rows.shape[0] else rows
        returned = exchange_rows(group, computed, send_counts=recv, recv_counts=send)
        out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        out.index_add_(0, row_tokens, returned.float())
        return out.to(hidden.dtype)
