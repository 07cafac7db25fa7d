"""Moving expert weights between the ranks of a group for a new placement.

Every rank works out the same plan from the old and new placement of a layer ([rank][slot]): a slot
whose expert the rank already holds copies it on its own device; any other expert comes from a rank
that holds it now (the holders take turns by receiving rank, to spread the sending), all in one
all-to-all per weight tensor. Nothing is read from host memory, so a rank needs no copy of the
experts it does not hold.
"""

from dataclasses import dataclass

import torch

from workers.engine.parallel.dispatch import exchange_rows
from workers.engine.parallel.groups import EPGroup


@dataclass(frozen=True, slots=True)
class TransferPlan:
    """One rank's part: old local slots to send, grouped by destination rank; how many rows come
    from each rank; and where each new slot's weights come from."""

    send_slots: list[int]  # old local slots, destination ranks in order
    send_counts: list[int]
    recv_counts: list[int]
    # Per new slot: ("local", old local slot) or ("received", row of the received weights).
    sources: list[tuple[str, int]]


def transfer_plan(old: list[list[int]], new: list[list[int]], rank: int) -> TransferPlan:
    size = len(old)
    holders: dict[int, list[int]] = {}
    for holder, experts in enumerate(old):
        for expert in experts:
            holders.setdefault(expert, [])
            if holder not in holders[expert]:
                holders[expert].append(holder)
    send_slots: list[int] = []
    send_counts = [0] * size
    recv_counts = [0] * size
    received: list[tuple[int, int]] = []  # (source rank, new slot), in the order rows arrive
    for destination, experts in enumerate(new):
        for slot, expert in enumerate(experts):
            if expert in old[destination]:
                continue
            source = holders[expert][destination % len(holders[expert])]
            if source == rank:
                send_slots.append(old[rank].index(expert))
                send_counts[destination] += 1
            if destination == rank:
                recv_counts[source] += 1
                received.append((source, slot))
    # Rows arrive grouped by source rank, each group in the sender's order (destination slot order).
    arrival = sorted(range(len(received)), key=lambda i: received[i][0])
    row_of_slot = {received[i][1]: row for row, i in enumerate(arrival)}
    sources = [
        ("local", old[rank].index(expert)) if expert in old[rank] else ("received", row_of_slot[slot])
        for slot, expert in enumerate(new[rank])
    ]
    return TransferPlan(send_slots=send_slots, send_counts=send_counts, recv_counts=recv_counts, sources=sources)


def move_experts(
    group: EPGroup, old: list[list[int]], new: list[list[int]], weights: list[torch.Tensor]
) -> list[torch.Tensor]:
    """The new local slots' weights ([slots, ...] each, like `weights`, the old local slots')."""
    plan = transfer_plan(old, new, group.rank)
    moved = []
    for tensor in weights:
        rows = tensor[torch.tensor(plan.send_slots, dtype=torch.int64, device=tensor.device)].flatten(1)
        received = exchange_rows(group, rows, send_counts=plan.send_counts, recv_counts=plan.recv_counts)
        received = received.view(-1, *tensor.shape[1:])
        moved.append(
            torch.stack([tensor[index] if kind == "local" else received[index] for kind, index in plan.sources])
        )
    return moved
