"""The routers DeepSeek configs build pick HF's experts with HF's weights."""

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV3Config
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from tests.workers.engine.models.deepseek_configs import V2_LITE, V3
from workers.engine.layers.moe import GroupedSigmoidRouter, GroupedSoftmaxRouter, build_router
from workers.engine.models.registry import model_config

HIDDEN, TOKENS = 32, 300

V2_ROUTINGS = {
    "greedy": {},
    # DeepSeek-V2's own: the best 3 of 8 groups, weights scaled by 16.
    "group_limited_greedy": {
        "topk_method": "group_limited_greedy",
        "n_group": 8,
        "topk_group": 3,
        "routed_scaling_factor": 16.0,
    },
}
V3_ROUTINGS = {
    "normalised": {"n_routed_experts": 64, "n_group": 8, "topk_group": 4},
    "unnormalised": {"n_routed_experts": 32, "n_group": 4, "topk_group": 2, "norm_topk_prob": False},
}


def by_expert(ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's choices in expert order, to compare choices as sets."""
    ids, order = ids.sort(dim=-1)
    return ids, weights.gather(1, order)


def routers(base: dict, override: dict, hf_config_class, hf_router_class, seed: int):
    raw = {**base, "hidden_size": HIDDEN, **override}
    ours = build_router(model_config(raw).moe, HIDDEN)
    theirs = hf_router_class(hf_config_class(**{k: v for k, v in raw.items() if k != "architectures"}))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(theirs.weight.shape, generator=generator))
        ours.weight.copy_(theirs.weight)
        if isinstance(theirs, DeepseekV3TopkRouter):
            theirs.e_score_correction_bias.copy_(torch.rand(theirs.weight.shape[0], generator=generator) * 0.2)
            ours.e_score_correction_bias.copy_(theirs.e_score_correction_bias)
    hidden = torch.randn(TOKENS, HIDDEN, generator=generator)
    return ours, theirs, hidden


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", V2_ROUTINGS)
def test_v2_routing_is_hfs(name, dtype):
    ours, theirs, hidden = routers(V2_LITE, V2_ROUTINGS[name], DeepseekV2Config, DeepseekV2TopkRouter, seed=1)
    hidden = hidden.to(dtype)

    ids, weights = by_expert(*ours(hidden))
    _, hf_weights, hf_ids = theirs(hidden)
    hf_ids, hf_weights = by_expert(hf_ids, hf_weights)

    assert isinstance(ours, GroupedSoftmaxRouter)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights, rtol=1e-6, atol=1e-6)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32


def test_group_limited_greedy_keeps_a_token_in_its_best_groups():
    ours, _, hidden = routers(V2_LITE, V2_ROUTINGS["group_limited_greedy"], DeepseekV2Config, DeepseekV2TopkRouter, 2)

    ids, _ = ours(hidden)
    probs = (hidden @ ours.weight.T).softmax(dim=-1).view(TOKENS, 8, 8)
    best_groups = probs.amax(dim=-1).topk(3, dim=-1).indices
    for token in range(TOKENS):
        assert set((ids[token] // 8).tolist()) <= set(best_groups[token].tolist())
    # Not the plain top-k: some token's best experts lie outside its best groups.
    plain = probs.view(TOKENS, 64).topk(6, dim=-1).indices
    assert not torch.equal(ids.sort(dim=-1).values, plain.sort(dim=-1).values)


@pytest.mark.parametrize("name", V3_ROUTINGS)
def test_v3_routing_is_hfs(name):
    ours, theirs, hidden = routers(V3, V3_ROUTINGS[name], DeepseekV3Config, DeepseekV3TopkRouter, seed=3)

    ids, weights = by_expert(*ours(hidden))
    _, hf_weights, hf_ids = theirs(hidden)
    hf_ids, hf_weights = by_expert(hf_ids, hf_weights)

    assert isinstance(ours, GroupedSigmoidRouter)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights, rtol=1e-6, atol=1e-6)
