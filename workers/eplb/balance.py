"""The balance metric fixed by issue 15: each expert's load split evenly over its replicas; per layer
the max over GPUs of GPU load divided by the mean."""

import numpy as np


def replica_counts(placement: np.ndarray, experts: int) -> np.ndarray:
    """How many slots hold each expert: [layers][experts] from placement [layers][gpus][slots]."""
    layers = placement.shape[0]
    flat = placement.reshape(layers, -1) + np.arange(layers)[:, None] * experts
    return np.bincount(flat.ravel(), minlength=layers * experts).reshape(layers, experts)


def gpu_loads(placement: np.ndarray, loads: np.ndarray) -> np.ndarray:
    """Load of each GPU [layers][gpus] with every expert's load split evenly over its replicas."""
    counts = replica_counts(placement, loads.shape[1])
    per_replica = loads / np.maximum(counts, 1)
    layers = placement.shape[0]
    slot_loads = np.take_along_axis(per_replica, placement.reshape(layers, -1), axis=1)
    return slot_loads.reshape(placement.shape).sum(axis=2)


def layer_balance(placement, loads) -> np.ndarray:
    """Max over mean GPU load per layer (1.0 for a layer without load)."""
    placement = np.asarray(placement)
    per_gpu = gpu_loads(placement, np.asarray(loads, dtype=np.float64))
    mean = per_gpu.mean(axis=1)
    return np.where(mean > 0, per_gpu.max(axis=1) / np.where(mean > 0, mean, 1.0), 1.0)


def slots_changed(previous, placement) -> float:
    """Fraction of slots whose expert differs between two placements of the same shape."""
    return float((np.asarray(previous) != np.asarray(placement)).mean())
