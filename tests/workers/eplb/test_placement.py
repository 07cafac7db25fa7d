import numpy as np
import pytest

from bench.eplb_loads import LoadsConfig, make_loads
from workers.eplb import PlacementInputError, layer_balance, place_experts, rebalance_experts, slots_changed
from workers.eplb.balance import replica_counts

SMALL = LoadsConfig(seed=11, layers=6, experts=32, gpus=8, slots=48, tokens=4096)


@pytest.fixture(scope="module")
def loads() -> dict:
    data = make_loads(SMALL)
    return {"base": np.asarray(data["base"]), "drift": np.asarray(data["drift"])}


def assert_valid(placement: np.ndarray, *, layers: int, experts: int, gpus: int, slots: int) -> None:
    assert placement.shape == (layers, gpus, slots // gpus)
    assert (replica_counts(placement, experts) >= 1).all(), "an expert has no slot"
    assert replica_counts(placement, experts).sum(axis=1).tolist() == [slots] * layers


def test_every_expert_placed_with_exactly_the_slots(loads):
    placement = place_experts(loads["base"], gpus=8, slots=48)

    assert_valid(placement, layers=6, experts=32, gpus=8, slots=48)
    # The hottest expert of each layer got replicas, and balance is far better than without them.
    hottest = loads["base"].argmax(axis=1)
    assert (replica_counts(placement, 32)[np.arange(6), hottest] > 1).all()
    contiguous = np.broadcast_to(np.arange(32).reshape(8, 4), (6, 8, 4))
    assert layer_balance(placement, loads["base"]).mean() < layer_balance(contiguous, loads["base"]).mean() - 0.5


def test_with_nodes_every_expert_stays_on_one_node(loads):
    placement = place_experts(loads["base"], gpus=8, slots=48, nodes=2)

    assert_valid(placement, layers=6, experts=32, gpus=8, slots=48)
    halves = placement.reshape(6, 2, -1)
    for layer in range(6):
        first, second = set(halves[layer, 0].tolist()), set(halves[layer, 1].tolist())
        assert not first & second
        assert len(first) == len(second) == 16


def test_equal_loads_need_no_moves_and_balance_perfectly():
    flat = np.full((2, 16), 100)

    placement = place_experts(flat, gpus=4, slots=16)

    assert layer_balance(placement, flat).tolist() == [1.0, 1.0]
    assert rebalance_experts(flat, placement, gpus=4, slots=16).tolist() == placement.tolist()


def test_migration_moves_fewer_slots_than_placing_again(loads):
    previous = place_experts(loads["base"], gpus=8, slots=48)

    moved = rebalance_experts(loads["drift"], previous, gpus=8, slots=48, target_balance=1.03)
    fresh = place_experts(loads["drift"], gpus=8, slots=48)

    assert_valid(moved, layers=6, experts=32, gpus=8, slots=48)
    assert 0 < slots_changed(previous, moved) < slots_changed(previous, fresh)
    kept = layer_balance(previous, loads["drift"])
    after = layer_balance(moved, loads["drift"])
    reachable = layer_balance(fresh, loads["drift"])
    # Every layer ends under the target or within reach of what placing from scratch gets.
    assert (after <= np.maximum(1.03, reachable + 0.005) + 1e-9).all()
    assert after.mean() < kept.mean()


def test_migration_keeps_layers_already_balanced(loads):
    previous = place_experts(loads["base"], gpus=8, slots=48)
    drift = loads["drift"].copy()
    drift[0] = loads["base"][0]

    moved = rebalance_experts(drift, previous, gpus=8, slots=48)

    assert moved[0].tolist() == previous[0].tolist()


@pytest.mark.parametrize(
    ("loads", "sizes", "message"),
    [
        ([[1, 2, 3, 4]], {"gpus": 3, "slots": 8}, "slots (8) must be divisible by gpus (3)"),
        ([[1, 2, 3, 4]], {"gpus": 2, "slots": 2}, "slots (2) must be at least the number of experts (4)"),
        ([[1, -2, 3, 4]], {"gpus": 2, "slots": 4}, "must not be negative: layer 0, expert 1 is -2"),
        ([[1, 2.5, 3, 4]], {"gpus": 2, "slots": 4}, "must be integer token counts"),
        ([[True, False]], {"gpus": 1, "slots": 2}, "must be integer token counts"),
        ([[1, 2], [3]], {"gpus": 1, "slots": 2}, "rectangular [layers][experts]"),
        ([1, 2, 3], {"gpus": 1, "slots": 3}, "rectangular [layers][experts]"),
        ([[1, 2, 3, 4]], {"gpus": 4, "slots": 4, "nodes": 3}, "gpus (4) must be divisible by nodes (3)"),
        ([[1, 2, 3, 4]], {"gpus": 0, "slots": 4}, "gpus must be a positive integer"),
    ],
)
def test_bad_inputs_are_refused_clearly(loads, sizes, message):
    with pytest.raises(PlacementInputError) as refused:
        place_experts(loads, **sizes)

    assert message in str(refused.value)


@pytest.mark.parametrize(
    ("previous", "message"),
    [
        ([[[0, 1], [2, 3]]] * 2, "shape [1, 2, 2]"),
        ([[[0, 1], [2, 2]]], "does not cover every expert: layer 0 lacks expert 3"),
        ([[[0, 1], [2, 9]]], "expert ids outside 0..3"),
        ([[[0.0, 1.0], [2.0, 3.0]]], "integer expert ids"),
    ],
)
def test_bad_previous_placements_are_refused(previous, message):
    with pytest.raises(PlacementInputError) as refused:
        rebalance_experts([[5, 1, 1, 1]], previous, gpus=2, slots=4)

    assert message in str(refused.value)


def test_previous_placement_spanning_nodes_is_refused():
    with pytest.raises(PlacementInputError, match="spreads expert 1 of layer 0 over several nodes"):
        rebalance_experts([[5, 1, 1, 1]], [[[0, 1], [0, 2], [3, 1], [2, 3]]], gpus=4, slots=8, nodes=2)
