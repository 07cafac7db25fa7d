"""The MoE block's parts: routers against brute force, and the experts module as a seam."""

import itertools

import pytest
import torch
from torch import nn

from kernels.moe import experts_reference
from workers.engine.layers.moe import GroupedSigmoidRouter, RoutedExperts, SoftmaxTopKRouter, SparseMoeBlock
from workers.protocol.errors import ModelLoadError

HIDDEN, EXPERTS, GROUPS, TOPK_GROUPS, TOP_K = 16, 16, 4, 2, 3


def grouped_router(bias: torch.Tensor | None = None, *, seed: int = 0) -> GroupedSigmoidRouter:
    router = GroupedSigmoidRouter(
        HIDDEN,
        EXPERTS,
        TOP_K,
        num_groups=GROUPS,
        topk_groups=TOPK_GROUPS,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    )
    with torch.no_grad():
        router.weight.copy_(torch.randn(EXPERTS, HIDDEN, generator=torch.Generator().manual_seed(seed)))
        if bias is not None:
            router.e_score_correction_bias.copy_(bias)
    return router


def brute_force_choice(choice: torch.Tensor) -> set[int]:
    """One token: the best topk_groups groups by the sum of each group's two best scores, then the
    TOP_K experts with the highest total score among all TOP_K-sets inside those groups."""
    per_group = EXPERTS // GROUPS
    score = choice.tolist()
    group_score = [sum(sorted(score[g * per_group : (g + 1) * per_group])[-2:]) for g in range(GROUPS)]
    groups = max(itertools.combinations(range(GROUPS), TOPK_GROUPS), key=lambda gs: sum(group_score[g] for g in gs))
    allowed = [e for g in groups for e in range(g * per_group, (g + 1) * per_group)]
    return set(max(itertools.combinations(allowed, TOP_K), key=lambda es: sum(score[e] for e in es)))


def test_group_limited_top_k_matches_brute_force():
    hidden = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(EXPERTS, generator=torch.Generator().manual_seed(2)) * 0.3
    router = grouped_router(bias)
    ids, weights = router(hidden)
    scores = (hidden @ router.weight.T).sigmoid()
    for t in range(hidden.shape[0]):
        assert set(ids[t].tolist()) == brute_force_choice(scores[t] + bias)
    chosen = scores.gather(1, ids)
    torch.testing.assert_close(weights, 2.5 * chosen / chosen.sum(dim=-1, keepdim=True))
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32


def test_correction_bias_changes_the_choice_not_the_weights():
    hidden = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(3))
    favoured = 5
    bias = torch.zeros(EXPERTS)
    bias[favoured] = 10.0
    plain_ids, plain_weights = grouped_router()(hidden)
    biased_router = grouped_router(bias)
    biased_ids, biased_weights = biased_router(hidden)
    assert (biased_ids == favoured).any(dim=-1).all()
    assert not (plain_ids == favoured).any(dim=-1).all()
    # Each chosen expert's weight is its unbiased score, renormalised: the bias never enters it.
    scores = (hidden @ biased_router.weight.T).sigmoid()
    chosen = scores.gather(1, biased_ids)
    torch.testing.assert_close(biased_weights, 2.5 * chosen / chosen.sum(dim=-1, keepdim=True))
    assert biased_weights.max() < 2.5  # a +10 bias inside the weight would dominate the sum


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_softmax_router_takes_the_most_probable_experts(norm_topk_prob):
    router = SoftmaxTopKRouter(HIDDEN, EXPERTS, TOP_K, norm_topk_prob=norm_topk_prob)
    nn.init.normal_(router.weight, generator=torch.Generator().manual_seed(4))
    hidden = torch.randn(20, HIDDEN, generator=torch.Generator().manual_seed(5))
    ids, weights = router(hidden)
    probs = (hidden @ router.weight.T).softmax(dim=-1)
    assert torch.equal(ids, probs.argsort(dim=-1, descending=True)[:, :TOP_K])
    expected = probs.gather(1, ids)
    if norm_topk_prob:
        expected = expected / expected.sum(dim=-1, keepdim=True)
    torch.testing.assert_close(weights, expected)


class PermutedSlotExperts(nn.Module):
    """Holds the experts in a shuffled slot order and maps expert ids to slots, as an
    expert-parallel module maps them to the slots of its placement."""

    def __init__(self, experts: RoutedExperts, order: torch.Tensor) -> None:
        super().__init__()
        self.w13 = experts.w13.detach()[order]
        self.w2 = experts.w2.detach()[order]
        self.slot_of = order.argsort()
        self.calls = 0

    def forward(self, hidden, topk_ids, topk_weights):
        self.calls += 1
        return experts_reference(hidden, self.w13, self.w2, self.slot_of[topk_ids], topk_weights)


def test_experts_module_is_replaceable():
    experts = RoutedExperts(EXPERTS, HIDDEN, 8)
    generator = torch.Generator().manual_seed(6)
    for param in experts.parameters():
        param.data.normal_(generator=generator)
    router = grouped_router()
    hidden = torch.randn(10, HIDDEN, generator=generator)
    with torch.no_grad():
        expected = SparseMoeBlock(router, experts)(hidden)
        block = SparseMoeBlock(router, experts)
        block.experts = PermutedSlotExperts(experts, torch.randperm(EXPERTS, generator=generator))
        swapped = block(hidden)
    assert block.experts.calls == 1
    torch.testing.assert_close(swapped, expected)


def test_expert_weight_of_the_wrong_shape_is_refused():
    experts = RoutedExperts(4, HIDDEN, 8)
    experts.load_expert_weight(2, "up", torch.ones(8, HIDDEN))
    assert torch.equal(experts.w13.data[2, 8:], torch.ones(8, HIDDEN))
    with pytest.raises(ModelLoadError, match=r"expert 1's down projection has shape \(8, 16\), expected \(16, 8\)"):
        experts.load_expert_weight(1, "down", torch.ones(8, HIDDEN))
    with pytest.raises(ModelLoadError, match="expert 4 is out of range"):
        experts.load_expert_weight(4, "gate", torch.ones(8, HIDDEN))
