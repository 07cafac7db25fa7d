"""The three steps of a placement, each vectorised over a batch of independent problems (layers, or
(layer, node) pairs): replica counts, greedy packing into equal-sized packs, swap refinement."""

import numpy as np

# A swap must lower its busy GPU by this fraction of the mean GPU load: smaller gains cost rounds
# and do not show in max/mean.
MIN_GAIN = 1e-3


def fill_replicas(loads: np.ndarray, slots: int) -> np.ndarray:
    """Replica counts [batch][experts] summing to `slots`, each at least 1: every spare slot goes to
    the expert with the highest load per replica, which minimises the largest replica load."""
    batch, experts = loads.shape
    counts = np.ones((batch, experts), dtype=np.int64)
    rows = np.arange(batch)
    # Ties between experts of no load still hand out every slot.
    per_replica = loads.astype(np.float64) + 1e-9
    for _ in range(slots - experts):
        hottest = np.argmax(per_replica / counts, axis=1)
        counts[rows, hottest] += 1
    return counts


def expand_replicas(counts: np.ndarray) -> np.ndarray:
    """The expert id of each replica [batch][slots], experts in order, each repeated `counts` times."""
    batch, _ = counts.shape
    slots = int(counts[0].sum())
    ends = np.cumsum(counts, axis=1) + np.arange(batch)[:, None] * slots
    wanted = np.arange(slots)[None, :] + np.arange(batch)[:, None] * slots
    return np.searchsorted(ends.ravel(), wanted.ravel(), side="right").reshape(batch, slots) % counts.shape[1]


def greedy_pack(weights: np.ndarray, packs: int) -> np.ndarray:
    """Items [batch][items] into `packs` packs of items/packs each, in rounds: each round hands the
    next `packs` heaviest items out one per pack, the heaviest to the lightest pack. Returns the item
    index in each place [batch][packs][items/packs]."""
    batch, items = weights.shape
    capacity = items // packs
    order = np.argsort(-weights, axis=1, kind="stable").reshape(batch, capacity, packs)
    rows = np.arange(batch)[:, None]
    pack_loads = np.zeros((batch, packs))
    arrangement = np.empty((batch, packs, capacity), dtype=np.int64)
    for place in range(capacity):
        lightest_first = np.argsort(pack_loads, axis=1, kind="stable")
        arrangement[rows, lightest_first, place] = order[:, place]
        pack_loads[rows, lightest_first] += weights[rows, order[:, place]]
    return arrangement


def swap_descent(
    placement: np.ndarray,
    per_replica: np.ndarray,
    *,
    stop_at: np.ndarray,
    gpus_per_node: int,
    passes: tuple[tuple[int, int], ...] = ((1, 1 << 30),),
    max_rounds: int = 1 << 30,
) -> np.ndarray:
    """Swap slots off the most loaded GPUs of each node while that lowers them, best swap first,
    until no swap helps or every GPU of the problem is under `stop_at`.

    placement [batch][gpus][slots] of expert ids (changed in place and returned); per_replica
    [batch][experts] the load of one replica of each expert (replica counts never change here);
    stop_at [batch] a GPU load that is good enough. Each pass (busy, partners) trades, every round,
    for each of the `busy` most loaded GPUs of a node, with the best of its own `partners` among the
    lightest GPUs (disjoint, so all swaps of a round apply together): many busy GPUs with few
    partners get most of the way in few rounds, one busy GPU with every partner finishes the job.
    """
    # float32 halves the memory each round streams through; MIN_GAIN is far above its rounding.
    per_replica = per_replica.astype(np.float32)
    for busy, partners in passes:
        _descend(
            placement,
            per_replica,
            stop_at=stop_at,
            gpus_per_node=gpus_per_node,
            busy=busy,
            partners=partners,
            max_rounds=max_rounds,
        )
    return placement


def _descend(
    placement: np.ndarray,
    per_replica: np.ndarray,
    *,
    stop_at: np.ndarray,
    gpus_per_node: int,
    busy: int,
    partners: int,
    max_rounds: int,
) -> None:
    batch, gpus, slots = placement.shape
    nodes = gpus // gpus_per_node
    busy = max(1, min(busy, gpus_per_node // 2))
    partners = min(partners, (gpus_per_node - busy) // busy)
    if partners < 1:
        return
    node_base = (np.arange(nodes) * gpus_per_node)[None, :, None]
    # The weight of every slot, swapped along with the slots so no round gathers them again.
    all_weights = np.take_along_axis(per_replica, placement.reshape(batch, -1), axis=1).reshape(placement.shape)
    least = all_weights.sum(axis=(1, 2)) / gpus * MIN_GAIN
    active = np.arange(batch)
    for _ in range(max_rounds):
        if not active.size:
            return
        weights = all_weights[active]
        rows = np.arange(active.size)[:, None, None]
        loads = weights.sum(axis=2)
        ranked = np.argsort(-loads.reshape(active.size, nodes, gpus_per_node), axis=2, kind="stable") + node_base
        heavy = ranked[:, :, :busy]
        # Partner q of busy GPU r is the (q * busy + r)-th lightest: the heaviest get the lightest.
        light = ranked[:, :, ::-1][:, :, : busy * partners].reshape(active.size, nodes, partners, busy)
        light = light.transpose(0, 1, 3, 2)
        heavy_load, light_load = loads[rows, heavy], loads[rows[..., None], light]
        # delta[b, n, r, i, q, j]: what busy GPU r sheds by trading its slot i for slot j of partner q.
        delta = weights[rows, heavy][:, :, :, :, None, None] - weights[rows[..., None], light][:, :, :, None, :, :]
        after = np.maximum(heavy_load[..., None, None, None] - delta, light_load[:, :, :, None, :, None] + delta)
        after = after.reshape(active.size, nodes, busy, -1)
        best = np.argmin(after, axis=3)
        gain = np.take_along_axis(after, best[..., None], axis=3)[..., 0] < heavy_load - least[active][:, None, None]
        gain &= (loads.max(axis=1) > stop_at[active])[:, None, None]
        if not gain.any():
            return
        b, n, r = np.nonzero(gain)
        mine, q, theirs = np.unravel_index(best[b, n, r], (slots, partners, slots))
        heavy_gpu, light_gpu = heavy[b, n, r], light[b, n, r, q]
        chosen = active[b]
        for table in (placement, all_weights):
            given = table[chosen, heavy_gpu, mine]
            table[chosen, heavy_gpu, mine] = table[chosen, light_gpu, theirs]
            table[chosen, light_gpu, theirs] = given
        active = np.unique(chosen)
