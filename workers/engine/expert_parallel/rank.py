"""One rank of an expert-parallel engine: its own LLMEngine (scheduler, KV, attention: data-parallel)
whose MoE layers' routed experts are ExpertParallelExperts over the rank's group.

Lockstep: every rank runs exactly one forward per EP step, so every MoE layer's collectives are
joined by every rank. A rank whose scheduler has nothing to run (no requests, or only requests
waiting for store fetches) runs an empty pass instead: each MoE layer with zero tokens.
"""

import torch
from torch import nn

from kernels.moe import experts as run_experts
from workers.engine.engine import LLMEngine
from workers.engine.layers.moe import RoutedExperts
from workers.engine.outputs import RequestDelta
from workers.engine.parallel.experts import ExpertParallelExperts
from workers.engine.parallel.groups import EPGroup
from workers.engine.parallel.placement import Placement, check_placement


def moe_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's MoE blocks in forward order: the modules whose `experts` are routed experts."""
    return [
        module
        for module in model.modules()
        if isinstance(getattr(module, "experts", None), RoutedExperts | ExpertParallelExperts)
    ]


def num_logical_experts(model: nn.Module) -> int:
    blocks = moe_blocks(model)
    if not blocks:
        raise ValueError("expert parallelism needs a mixture-of-experts model; this one has no MoE layers")
    return _weights(blocks[0].experts)[0].shape[0]


class RankEngine:
    def __init__(self, engine: LLMEngine, group: EPGroup, placement: Placement) -> None:
        self.engine = engine
        self.blocks = moe_blocks(engine.runner.model)
        self.num_experts = num_logical_experts(engine.runner.model)
        check_placement(placement, num_layers=len(self.blocks), num_experts=self.num_experts, num_ranks=group.size)
        for block, layer in zip(self.blocks, placement, strict=True):
            w13, w2 = _weights(block.experts)
            block.experts = ExpertParallelExperts(
                group=group,
                host_w13=w13,
                host_w2=w2,
                placement=layer,
                top_k=block.router.top_k,
                compute=run_experts,
            )
        self.layers: list[ExpertParallelExperts] = [block.experts for block in self.blocks]
        self.group = group
        self.placement = placement

    @property
    def slots_per_rank(self) -> int:
        return len(self.placement[0][0])

    def step(self) -> list[RequestDelta]:
        """One lockstep step: the engine's step, or the empty pass when it ran no forward."""
        calls = self.layers[0].num_calls
        deltas = self.engine.step()
        if self.layers[0].num_calls == calls:
            self.empty_pass()
        return deltas

    def empty_pass(self) -> None:
        """Join every MoE layer's collectives with no tokens of this rank's own."""
        device = self.group.device
        dtype = self.layers[0].w13.dtype
        hidden = torch.empty((0, self.layers[0].w13.shape[-1]), dtype=dtype, device=device)
        with torch.inference_mode():
            for layer in self.layers:
                ids = torch.empty((0, layer.top_k), dtype=torch.int64, device=device)
                weights = torch.empty((0, layer.top_k), dtype=torch.float32, device=device)
                layer(hidden, ids, weights)

    def apply_placement(self, placement: Placement, group: EPGroup | None = None) -> None:
        """Put `placement` in force (for `group`, after a resize): every layer is staged first, so a
        placement that fails to stage changes nothing; then all layers switch at once."""
        group = group or self.group
        check_placement(placement, num_layers=len(self.layers), num_experts=self.num_experts, num_ranks=group.size)
        staged = [layer.stage(group, part) for layer, part in zip(self.layers, placement, strict=True)]
        for layer, part in zip(self.layers, staged, strict=True):
            layer.install(part)
        self.group = group
        self.placement = placement

    def take_load(self) -> list[list[int]]:
        """Per MoE layer, this rank's pairs routed to each physical slot since the last take (one
        device-to-host copy for all layers)."""
        if not self.layers:
            return []
        return torch.stack([layer.take_load() for layer in self.layers]).tolist()


def _weights(routed: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """A routed-experts module's stacked weights: w13 [E, 2I, H] (gate rows, then up), w2 [E, H, I]."""
    if isinstance(routed, ExpertParallelExperts):
        return routed.host_w13, routed.host_w2
    return routed.w13, routed.w2
