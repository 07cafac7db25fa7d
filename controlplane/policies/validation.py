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
    """Field-level errors of a placement (placement[rank][slot] = logical expert id); {} when valid.

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
        and all(isinstance(rank, list) and all(_is_int(expert) for expert in rank) for rank in placement)
    ):
        errors["placement"] = ["must be a non-empty list of ranks, each a list of logical expert ids (integers)"]
        return errors
    messages = []
    if len(placement) > max_ranks:
        messages.append(f"{len(placement)} ranks, but the pool has {max_ranks}")
    crowded = [rank for rank, slots in enumerate(placement) if len(slots) > expert_slots_per_rank]
    if crowded:
        messages.append(f"ranks {crowded} hold more than {expert_slots_per_rank} experts (the pool's slots per rank)")
    if "num_logical_experts" not in errors:
        placed = {expert for rank in placement for expert in rank}
        out_of_range = sorted(expert for expert in placed if not 0 <= expert < num_logical_experts)
        if out_of_range:
            messages.append(f"expert ids {out_of_range} are outside 0..{num_logical_experts - 1}")
        num_slots = sum(len(rank) for rank in placement)
        if num_logical_experts > num_slots:
            # Listing the missing ids would take memory in proportion to a number the caller chose.
            messages.append(f"{num_logical_experts} experts do not fit in {num_slots} slots: some have no slot")
        else:
            missing = sorted(set(range(num_logical_experts)) - placed)
            if missing:
                messages.append(f"experts {missing} have no slot")
    if messages:
        errors["placement"] = messages
    return errors


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
