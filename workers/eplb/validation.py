"""Input checks for the EPLB: every refusal is a PlacementInputError that says what is wrong."""

import numpy as np


class PlacementInputError(ValueError):
    """Loads, sizes or a previous placement the EPLB cannot place from."""


def checked_loads(loads) -> np.ndarray:
    """Loads as an int64 array [layers][experts] of non-negative integer token counts."""
    try:
        array = np.asarray(loads)
    except ValueError as error:
        raise PlacementInputError(f"loads must be a rectangular [layers][experts] array: {error}") from None
    if array.dtype == object or array.ndim != 2:
        raise PlacementInputError(f"loads must be a rectangular [layers][experts] array, got shape {array.shape}")
    if array.shape[0] < 1 or array.shape[1] < 1:
        raise PlacementInputError(f"loads need at least one layer and one expert, got shape {array.shape}")
    if array.dtype.kind not in "iu":
        raise PlacementInputError(f"loads must be integer token counts, got {array.dtype}")
    if (array < 0).any():
        layer, expert = np.argwhere(array < 0)[0]
        raise PlacementInputError(
            f"loads must not be negative: layer {layer}, expert {expert} is {array[layer, expert]}"
        )
    return array.astype(np.int64)


def check_sizes(*, experts: int, gpus: int, slots: int, nodes: int) -> None:
    """Sizes the placement can have: whole slots per GPU, every expert placed, whole GPUs per node."""
    for name, value in (("gpus", gpus), ("slots", slots), ("nodes", nodes)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
            raise PlacementInputError(f"{name} must be a positive integer, got {value!r}")
    if slots % gpus:
        raise PlacementInputError(f"slots ({slots}) must be divisible by gpus ({gpus})")
    if slots < experts:
        raise PlacementInputError(f"slots ({slots}) must be at least the number of experts ({experts})")
    if gpus % nodes:
        raise PlacementInputError(f"gpus ({gpus}) must be divisible by nodes ({nodes})")
    if nodes > 1 and experts % nodes:
        raise PlacementInputError(f"experts ({experts}) must be divisible by nodes ({nodes}) to group them onto nodes")


def checked_placement(placement, *, layers: int, experts: int, gpus: int, slots: int, nodes: int) -> np.ndarray:
    """A previous placement as an int64 array [layers][gpus][slots per gpu] covering every expert."""
    shape = (layers, gpus, slots // gpus)
    try:
        array = np.asarray(placement)
    except ValueError as error:
        raise PlacementInputError(f"placement must be a rectangular [layers][gpus][slots] array: {error}") from None
    if array.dtype == object or array.shape != shape:
        raise PlacementInputError(
            f"placement must have shape {list(shape)} [layers][gpus][slots], got {list(array.shape)}"
        )
    if array.dtype.kind not in "iu":
        raise PlacementInputError(f"placement must hold integer expert ids, got {array.dtype}")
    if ((array < 0) | (array >= experts)).any():
        raise PlacementInputError(f"placement holds expert ids outside 0..{experts - 1}")
    array = array.astype(np.int64)
    present = np.zeros((layers, experts), dtype=bool)
    np.put_along_axis(present, array.reshape(layers, -1), True, axis=1)
    if not present.all():
        layer, expert = np.argwhere(~present)[0]
        raise PlacementInputError(f"placement does not cover every expert: layer {layer} lacks expert {expert}")
    if nodes > 1:
        node_of_slot = np.repeat(np.arange(nodes), slots // nodes)
        for layer in range(layers):
            spans = np.zeros((experts, nodes), dtype=bool)
            spans[array[layer].reshape(-1), node_of_slot] = True
            split = np.flatnonzero(spans.sum(1) > 1)
            if split.size:
                raise PlacementInputError(
                    f"placement spreads expert {split[0]} of layer {layer} over several nodes; with nodes "
                    "every expert's replicas stay on one node"
                )
    return array
