"""The MoE expert ops: the per-expert reference against a per-token computation, and the checked
entry point's refusals."""

import pytest
import torch
import torch.nn.functional as F

from kernels.moe import experts, experts_reference


def make_inputs(tokens=13, hidden=32, intermediate=24, slots=6, k=3, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=generator).to(dtype)
    w13 = (torch.randn(slots, 2 * intermediate, hidden, generator=generator) * 0.2).to(dtype)
    w2 = (torch.randn(slots, hidden, intermediate, generator=generator) * 0.2).to(dtype)
    # k distinct slots per token, then about one in four marked "not here" (-1).
    ids = torch.rand(tokens, slots, generator=generator).argsort(dim=-1)[:, :k]
    ids[torch.rand(tokens, k, generator=generator) < 0.25] = -1
    weights = torch.rand(tokens, k, generator=generator)
    return x, w13, w2, ids, weights


def per_token(x, w13, w2, ids, weights):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for slot, weight in zip(ids[t].tolist(), weights[t].tolist()):
            if slot >= 0:
                gate, up = (w13[slot] @ x[t]).chunk(2)
                out[t] += weight * (w2[slot] @ (F.silu(gate) * up))
    return out


def test_reference_is_the_weighted_sum_over_held_slots():
    inputs = make_inputs()
    torch.testing.assert_close(experts_reference(*inputs), per_token(*inputs), atol=1e-5, rtol=1e-5)


def test_tokens_routed_nowhere_here_get_zero():
    x, w13, w2, ids, weights = make_inputs()
    ids[:4] = -1
    out = experts(x, w13, w2, ids, weights)
    assert torch.equal(out[:4], torch.zeros_like(out[:4]))
    assert out[4:].abs().sum() > 0


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda i: {**i, "x": i["x"][None]}, "hidden must be"),
        (lambda i: {**i, "w13": i["w13"][:, :-1]}, "w13 must be"),
        (lambda i: {**i, "w2": i["w2"][:-1]}, "w2 must be"),
        (lambda i: {**i, "w2": i["w2"].double()}, "w2 must be torch.float32"),
        (lambda i: {**i, "ids": i["ids"].int()}, "topk_slots must be int64"),
        (lambda i: {**i, "ids": i["ids"][:-1]}, "topk_slots must be"),
        (lambda i: {**i, "weights": i["weights"].half()}, "topk_weights must be float32"),
        (lambda i: {**i, "weights": i["weights"][:, :1]}, "topk_weights must be"),
        (lambda i: {**i, "ids": i["ids"].clamp(min=0) + 5}, r"topk_slots must be in \[-1, 6\)"),
        (lambda i: {**i, "ids": i["ids"].clamp(max=0) - 1}, r"topk_slots must be in \[-1, 6\)"),
    ],
)
def test_bad_inputs_are_refused(change, message):
    x, w13, w2, ids, weights = make_inputs()
    bad = change({"x": x, "w13": w13, "w2": w2, "ids": ids, "weights": weights})
    with pytest.raises(ValueError, match=message):
        experts(bad["x"], bad["w13"], bad["w2"], bad["ids"], bad["weights"])
