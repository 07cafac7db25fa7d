"""MTP speculation on the device path (Triton attention, persistent input batch) on the CPU, under
Triton's interpreter: the runner drafts from each step's hidden states once its result is read, the
MTP layer's attention running on the Triton kernels over device tensors built from its host lists;
its drafts are the reference path's and the tokens those of decoding without speculation."""

import pytest
import torch
from msgspec.structs import replace

from tests.workers.engine.spec.test_mtp_speculation import CONFIG, SETTINGS, greedy, prompts, recording_drafts
from workers.engine import LLM

pytest.importorskip("triton")
CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="runs on the CPU under Triton's interpreter")


def copying_a_little(llm: LLM) -> LLM:
    """Tilt the random MTP layer towards drafting the token it is given (its head made the tied
    embedding, a little of that embedding added through eh_proj), so that some of its drafts are
    accepted, some in part, and the others still come from its attention over its latents."""
    model = llm.engine.runner.model
    layer = model.mtp.layers[0]
    hidden = CONFIG["hidden_size"]
    with torch.no_grad():
        layer.eh_proj.weight[:, :hidden] += 0.1 * torch.eye(hidden)
    layer.shared_head.head.weight = model.embed_tokens.weight
    return llm


# The last request reports logprobs: while it runs, steps verify on the host Sampler, then on the device.
PARAMS = [greedy(10), greedy(10), replace(greedy(4), logprobs=1)]


def drafts_and_tokens(llm: LLM) -> tuple[list[list[list[int]]], list[list[int]]]:
    """Each request's drafts after each of its steps, and its tokens, in prompt order."""
    made = recording_drafts(llm)
    results = llm.generate(prompts(3), PARAMS)
    return [made[f"{r.request_id}-0"] for r in results], [r.outputs[0].token_ids for r in results]


@CPU_ONLY
def test_mtp_on_the_device_path_drafts_as_the_reference_path_and_keeps_the_target_s_tokens():
    # Prompts of 9, 13 and 17 tokens in steps of 8: chunks that sample nothing run the layer too.
    settings = dict(SETTINGS, spec_method="mtp", spec_max_draft_tokens=3, max_num_batched_tokens=8)
    expected = [r.outputs[0].token_ids for r in LLM(CONFIG, **SETTINGS).generate(prompts(3), PARAMS)]
    reference = copying_a_little(LLM(CONFIG, **settings))
    device = copying_a_little(LLM(CONFIG, **settings, attention_backend="triton"))

    reference_drafts, _ = drafts_and_tokens(reference)
    drafts, tokens = drafts_and_tokens(device)

    assert tokens == expected
    assert drafts == reference_drafts
    stats, reference_stats = device.engine.stats().spec_decode, reference.engine.stats().spec_decode
    assert stats.num_accepted_tokens > 0
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (
        reference_stats.num_drafts,
        reference_stats.num_draft_tokens,
        reference_stats.num_accepted_tokens,
    )
