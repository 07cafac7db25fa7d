"""EP layout checks as a pure function, shared by the services and the API serializer."""

from typing import Any


def ep_layout_errors(
    *,
    placement: Any,
    num_logical_experts: Any,
    pool_num_experts: int,
    expert_slots_per_rank: int,
    max_ranks: int,
) -> dict[str, list[str]]:
    """Field-level errors of a placement (placement[layer][rank][slot] = logical expert id); {} when
    valid. Every layer has the same ranks, every rank the same number of slots (workers hold fixed
    slots), and every layer gives every expert a slot.

    max_ranks: how many ranks the pool has to hold the layout (see ep_layout_max_ranks).
    """
    errors: dict[str, list[str]] = {}
    if not _is_int(num_logical_experts) or num_logical_experts < 1:
        errors["num_logical_experts"] = ["must be an integer >= 1"]
    elif pool_num_experts > 0 and num_logical_experts != pool_num_experts:
        errors["num_logical_experts"] = [f"must be {pool_num_experts}, the pool's number of experts"]
    if not (
        isinstance(placement, list)
        and placement
        and all(
            isinstance(ranks, list)
            and ranks
            and all(isinstance(held, list) and all(_is_int(expert) for expert in held) for held in ranks)
            for ranks in placement
        )
    ):
        errors["placement"] = [
            "must be a non-empty list of layers, each a non-empty list of ranks, each a list of logical expert "
            "ids (integers): placement[layer][rank][slot]"
        ]
        return errors
    messages = []
    num_ranks, num_slots = len(placement[0]), len(placement[0][0])
    if any(len(ranks) != num_ranks for ranks in placement):
        messages.append(f"every layer must have the same number of ranks ({num_ranks}, as layer 0)")
    elif num_ranks > max_ranks:
        messages.append(f"{num_ranks} ranks, but the pool has {max_ranks}")
    if any(len(held) != num_slots for ranks in placement for held in ranks):
        messages.append(f"every rank must hold the same number of slots ({num_slots}, as rank 0 of layer 0)")
    elif num_slots > expert_slots_per_rank:
        messages.append(f"ranks hold {num_slots} experts, more than the pool's {expert_slots_per_rank} slots per rank")
    if "num_logical_experts" not in errors and not messages:
        for layer, ranks in enumerate(placement):
            problem = _coverage_error(ranks, num_logical_experts)
            if problem:
                messages.append(f"layer {layer}: {problem}")
                break
    if messages:
        errors["placement"] = messages
    return errors


def _coverage_error(ranks: list[list[int]], num_logical_experts: int) -> str:
    placed = {expert for held in ranks for expert in held}
    out_of_range = sorted(expert for expert in placed if not 0 <= expert < num_logical_experts)
    if out_of_range:
        return f"expert ids {out_of_range} are outside 0..{num_logical_experts - 1}"
    num_slots = sum(len(held) for held in ranks)
    if num_logical_experts > num_slots:
        # Listing the missing ids would take memory in proportion to a number the caller chose.
        return f"{num_logical_experts} experts do not fit in {num_slots} slots: some have no slot"
    missing = sorted(set(range(num_logical_experts)) - placed)
    return f"experts {missing} have no slot" if missing else ""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
