"""The real SmolLM2-135M-Instruct with n-gram speculation: an answer that quotes its prompt is drafted
from it, and greedy decoding emits exactly the tokens it emits without speculation."""

import pytest

from workers.engine import LLM, SamplingParams

pytestmark = pytest.mark.slow

QUOTING_PROMPT = (
    "<|im_start|>user\nRepeat this sentence exactly, word for word: The quick brown fox jumps over the "
    "lazy dog while the farmer counts seven sheep by the old river.<|im_end|>\n<|im_start|>assistant\n"
)


def test_greedy_answer_quoting_its_prompt_is_the_same_and_drafts_are_accepted():
    base = LLM("smollm2-135m-instruct", max_num_batched_tokens=512)
    spec = LLM("smollm2-135m-instruct", max_num_batched_tokens=512, spec_method="ngram")
    prompt = base.tokenizer.encode(QUOTING_PROMPT)
    params = SamplingParams(temperature=0.0, max_tokens=40, logprobs=1)

    expected = base.generate([prompt], params)[0]
    result = spec.generate([prompt], params)[0]

    assert result.token_ids == expected.token_ids
    assert result.text == expected.text
    assert "quick brown fox" in result.text
    assert [(e.token_id, e.rank) for e in result.logprobs] == [(e.token_id, e.rank) for e in expected.logprobs]
    assert [e.logprob for e in result.logprobs] == pytest.approx([e.logprob for e in expected.logprobs], abs=1e-4)
    stats = spec.engine.stats().spec_decode
    assert stats.num_accepted_tokens >= 10
    assert spec.engine.stats().steps.num_steps < base.engine.stats().steps.num_steps
