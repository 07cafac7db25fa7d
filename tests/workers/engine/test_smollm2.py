"""The real SmolLM2-135M-Instruct: token-exact against transformers, batch-invariant, text and stops."""

import pytest
import torch

from bench.held_prompts import held_prompts
from workers.engine import LLM, SamplingParams

pytestmark = pytest.mark.slow

NEW_TOKENS = 64


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("smollm2-135m-instruct", max_num_batched_tokens=512)


@pytest.fixture(scope="module")
def prompts(llm: LLM) -> list[list[int]]:
    return held_prompts(llm.tokenizer)


def test_greedy_equals_transformers_generate_for_64_tokens(llm, prompts, transformers_smollm2):
    ours = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    for prompt, result in zip(prompts, ours, strict=True):
        with torch.inference_mode():
            # eos_token_id=None as an argument (in a config None means "unset"): no stopping, so both sides
            # produce exactly 64 tokens. An explicit mask, or HF would mask every <|im_end|> as padding.
            reference = transformers_smollm2.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=2,
            )
        assert result.token_ids == reference[0, len(prompt) :].tolist()


def test_the_answer_reads_right_and_stops_at_end_of_turn(llm, prompts):
    result = llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS))[0]
    assert "Paris" in result.text
    assert result.finish_reason == "stop"
    assert result.token_ids[-1] in llm.tokenizer.eos_token_ids
    assert result.text == llm.tokenizer.decode(result.token_ids)


def test_stop_string_truncates_text_and_ends_generation(llm, prompts):
    free = llm.generate([prompts[5]], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))[0]
    stop = free.text[10:13]
    stopped = llm.generate([prompts[5]], SamplingParams(temperature=0.0, max_tokens=40, stop=(stop,)))[0]
    assert stopped.finish_reason == "stop" and stopped.outputs[0].stop_reason == stop
    assert stopped.text == free.text[: free.text.index(stop)]
    assert len(stopped.token_ids) < len(free.token_ids)


def test_batch_of_32_gives_each_request_the_tokens_it_gets_alone(llm, prompts):
    requests = [prompts[i % len(prompts)][: 8 + 5 * i] for i in range(32)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    alone = [llm.generate([p], params)[0].token_ids for p in requests]
    batched = [r.token_ids for r in llm.generate(requests, params)]
    assert batched == alone
