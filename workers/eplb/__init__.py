"""Expert placement (EPLB): turns per-layer loads of logical experts into `placement[layer][gpu][slot]`.

`place_experts` places from scratch; `rebalance_experts` starts from the placement in force and moves
few slots. Pure numpy, no torch and no Django, so the control plane and the bench share it.
"""

from workers.eplb.balance import layer_balance, slots_changed
from workers.eplb.placement import place_experts, rebalance_experts
from workers.eplb.validation import PlacementInputError

__all__ = ["PlacementInputError", "layer_balance", "place_experts", "rebalance_experts", "slots_changed"]
