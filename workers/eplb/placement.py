"""Placing experts from scratch, and re-placing them from the placement in force when the load drifts."""

import numpy as np

from workers.eplb.balance import layer_balance, replica_counts
from workers.eplb.packing import expand_replicas, fill_replicas, greedy_pack, swap_descent
from workers.eplb.validation import PlacementInputError, check_sizes, checked_loads, checked_placement

# A re-placement stops once every layer's max/mean GPU load is at most this.
DEFAULT_TARGET_BALANCE = 1.025
# A layer no placement gets under the target aims at what placing from scratch reaches plus this.
UNREACHABLE_MARGIN = 0.005
# Re-homing gives up on a layer after this many re-homed slots in a row that did not lower its max/mean.
PATIENCE = 2
# Placing from scratch re-homes replicas in layers above this max/mean.
SCRATCH_GOAL = 1.01
# ... at most this many slots per layer, each followed by at most this many rounds of swaps: more
# slows placing down (2-4x on skewed loads) for a little balance.
SCRATCH_REHOMES = 4
SCRATCH_SWAP_ROUNDS = 4
# A re-placement re-homes this many slots of each layer above its target before it swaps: a
# re-homed slot changes one slot, a swap two, and drift often needs new replica counts anyway.
MIGRATION_REHOMES_FIRST = 3


def place_experts(loads, *, gpus: int, slots: int, nodes: int = 1) -> np.ndarray:
    """A placement [layers][gpus][slots // gpus] of logical expert ids for loads [layers][experts].

    With nodes > 1 every expert's replicas stay on one node (experts/nodes experts per node): the
    experts are grouped onto nodes by load first, then each node is placed on its own GPUs.
    """
    loads = checked_loads(loads)
    layers, experts = loads.shape
    check_sizes(experts=experts, gpus=gpus, slots=slots, nodes=nodes)
    if nodes == 1:
        placement = _place_flat(loads, gpus=gpus, slots=slots)
    else:
        placement = _place_grouped(loads, gpus=gpus, slots=slots, nodes=nodes)
    # Replica counts by load per replica are not always the counts that pack best: re-homing
    # replicas lowers the layers that packing leaves above SCRATCH_GOAL.
    goal = np.full(layers, SCRATCH_GOAL)
    return _refine(
        placement,
        loads,
        goal=goal,
        gpus_per_node=gpus // nodes,
        rehomes=SCRATCH_REHOMES,
        swap_rounds=SCRATCH_SWAP_ROUNDS,
    )


def _place_grouped(loads: np.ndarray, *, gpus: int, slots: int, nodes: int) -> np.ndarray:
    layers, experts = loads.shape
    # Each node holds experts/nodes experts: a packing of experts (one item each) into nodes.
    grouping = greedy_pack(loads.astype(np.float64), nodes)
    grouping = swap_descent(grouping, loads.astype(np.float64), stop_at=np.zeros(layers), gpus_per_node=nodes)
    node_experts = grouping.reshape(layers * nodes, experts // nodes)
    node_loads = np.take_along_axis(np.repeat(loads, nodes, axis=0), node_experts, axis=1)
    local = _place_flat(node_loads, gpus=gpus // nodes, slots=slots // nodes)
    placement = np.take_along_axis(node_experts, local.reshape(layers * nodes, -1), axis=1)
    return placement.reshape(layers, gpus, slots // gpus)


def _place_flat(loads: np.ndarray, *, gpus: int, slots: int) -> np.ndarray:
    """Replica counts by load per replica, the heaviest replicas first onto the lightest GPUs, then
    swaps off the most loaded GPUs while they help."""
    counts = fill_replicas(loads, slots)
    per_replica = loads / counts
    replica_expert = expand_replicas(counts)
    replica_load = np.take_along_axis(per_replica, replica_expert, axis=1)
    arrangement = greedy_pack(replica_load, gpus)
    batch = loads.shape[0]
    placement = np.take_along_axis(replica_expert, arrangement.reshape(batch, -1), axis=1).reshape(arrangement.shape)
    # Many busy GPUs with a few partners each, then fewer with more; _refine polishes the layers that
    # stay above SCRATCH_GOAL with the busiest against all.
    passes = ((max(1, gpus // 4), 3), (max(1, gpus // 16), 15))
    return swap_descent(placement, per_replica, stop_at=np.zeros(batch), gpus_per_node=gpus, passes=passes)


def rebalance_experts(
    loads,
    previous,
    *,
    gpus: int,
    slots: int,
    nodes: int = 1,
    target_balance: float = DEFAULT_TARGET_BALANCE,
) -> np.ndarray:
    """A placement close to `previous` for new loads: a layer at most `target_balance` max/mean
    keeps every slot; otherwise slots are swapped off its most loaded GPU, and when swaps no longer
    help, one slot of an expert with a replica to spare is re-homed to the heaviest expert of that
    GPU (within its node), then swaps again, until the layer is under the target.

    A layer whose load no placement brings under the target (what placing it from scratch reaches,
    plus UNREACHABLE_MARGIN, is the bar then) stops there, and one that stops gaining keeps the best
    placement it went through, so chasing the impossible costs no slots.
    """
    loads = checked_loads(loads)
    layers, experts = loads.shape
    check_sizes(experts=experts, gpus=gpus, slots=slots, nodes=nodes)
    placement = checked_placement(previous, layers=layers, experts=experts, gpus=gpus, slots=slots, nodes=nodes).copy()
    if not target_balance >= 1.0:
        raise PlacementInputError(f"target_balance must be at least 1.0, got {target_balance!r}")
    if not (layer_balance(placement, loads) > target_balance).any():
        return placement
    reachable = layer_balance(place_experts(loads, gpus=gpus, slots=slots, nodes=nodes), loads)
    goal = np.maximum(target_balance, reachable + UNREACHABLE_MARGIN)
    return _refine(
        placement, loads, goal=goal, gpus_per_node=gpus // nodes, rehomes=slots, rehomes_first=MIGRATION_REHOMES_FIRST
    )


def _refine(
    placement: np.ndarray,
    loads: np.ndarray,
    *,
    goal: np.ndarray,
    gpus_per_node: int,
    rehomes: int,
    rehomes_first: int = 0,
    swap_rounds: int = 1 << 30,
) -> np.ndarray:
    """For every layer above its `goal` max/mean: `rehomes_first` re-homed slots, then swaps, then
    one re-homed slot and swaps again, until it is under it or PATIENCE re-homings in a row did not
    lower it; each layer ends at the best placement it went through. Changes `placement`; returns
    the best."""
    layers, experts = loads.shape
    gpus = placement.shape[1]
    stop_at = goal * loads.sum(axis=1) / gpus
    best_balance = layer_balance(placement, loads)
    best = placement.copy()
    stale = np.zeros(layers, dtype=np.int64)
    active = np.flatnonzero(best_balance > goal)
    for _ in range(rehomes_first if active.size else 0):
        part = placement[active]
        _rehome_one(part, loads[active], gpus_per_node)
        placement[active] = part
    for _ in range(rehomes + 1):
        if not active.size:
            break
        per_replica = loads / np.maximum(replica_counts(placement, experts), 1)
        part = swap_descent(
            placement[active],
            per_replica[active],
            stop_at=stop_at[active],
            gpus_per_node=gpus_per_node,
            max_rounds=swap_rounds,
        )
        placement[active] = part
        now = layer_balance(part, loads[active])
        gained = now < best_balance[active] - 1e-9
        best[active[gained]] = part[gained]
        best_balance[active[gained]] = now[gained]
        stale[active] = np.where(gained, 0, stale[active] + 1)
        active = active[(now > goal[active]) & (stale[active] < PATIENCE)]
        if active.size:
            part = placement[active]
            found = _rehome_one(part, loads[active], gpus_per_node)
            placement[active] = part
            active = active[found]
    return best


def _rehome_one(placement: np.ndarray, loads: np.ndarray, gpus_per_node: int) -> np.ndarray:
    """In each layer, give the heaviest expert of the most loaded GPU one more replica, taking the
    slot of the expert that loses least by giving one up, on the lightest such GPU of the same node.
    placement [layers][gpus][slots] changes in place; returns whether each layer found a donor."""
    layers, gpus, slots = placement.shape
    experts = loads.shape[1]
    rows = np.arange(layers)
    counts = replica_counts(placement, experts)
    per_replica = loads / np.maximum(counts, 1)
    flat = placement.reshape(layers, -1)
    weights = np.take_along_axis(per_replica, flat, axis=1).reshape(placement.shape)
    gpu_loads = weights.sum(axis=2)
    busiest = np.argmax(gpu_loads, axis=1)
    hot = placement[rows, busiest, np.argmax(weights[rows, busiest], axis=1)]
    slot_counts = np.take_along_axis(counts, flat, axis=1).reshape(placement.shape)
    same_node = (np.arange(gpus)[None, :] // gpus_per_node) == (busiest // gpus_per_node)[:, None]
    spare = (slot_counts > 1) & (placement != hot[:, None, None]) & same_node[:, :, None]
    # What the donor's replicas each carry once it gives this slot up; ties go to the lighter GPU.
    after = np.take_along_axis(loads, flat, axis=1).reshape(placement.shape) / np.maximum(slot_counts - 1, 1)
    cost = after + gpu_loads[:, :, None] / np.maximum(gpu_loads.sum(axis=1), 1.0)[:, None, None] * 1e-6
    cost = np.where(spare, cost, np.inf).reshape(layers, -1)
    donor = np.argmin(cost, axis=1)
    found = np.isfinite(cost[rows, donor])
    flat[rows[found], donor[found]] = hot[found]
    return found
