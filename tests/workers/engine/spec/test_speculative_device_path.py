"""Speculation on the device path (Triton attention, persistent input batch, on-device sampling) on
the CPU, under Triton's interpreter: steps of greedy and plainly sampled rows verify their drafts on
the device, eagerly or padded to the buckets a CUDA graph replays; steps whose rows need the host
Sampler verify there; and the tokens are the reference path's without speculation."""

import pytest
import torch
from msgspec.structs import replace

from tests.workers.engine.hf_reference import TINY_CONFIGS
from tests.workers.engine.spec.test_speculative_engine import repeating_prompts
from workers.engine import LLM, SamplingParams
from workers.engine.runner import model_runner
from workers.engine.runner.cuda_graphs import StepGraphs, decode_layouts, verify_layouts
from workers.engine.runner.input_batch import StepPlan
from workers.engine.runner.request_states import RequestStates
from workers.engine.sched.output import SchedulerOutput

pytest.importorskip("triton")
CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="runs on the CPU under Triton's interpreter")

PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.0, max_tokens=15, ignore_eos=True, presence_penalty=0.3, frequency_penalty=0.2),
    SamplingParams(temperature=0.8, top_k=20, seed=5, max_tokens=14, ignore_eos=True, repetition_penalty=1.1),
]


@CPU_ONLY
@pytest.mark.parametrize("name", ["llama", "qwen3_qknorm_layer_types"])
def test_device_path_with_speculation_gives_the_reference_tokens_without_it(name):
    prompts = repeating_prompts(4, seed=6)
    # Biased towards each prompt's tokens, so the sampled and penalised requests quote it too.
    params = [replace(p, logit_bias={t: 3.0 for t in set(q)}) for p, q in zip(PARAMS, prompts, strict=True)]
    reference = LLM(TINY_CONFIGS[name], seed=0, kv_cache_bytes=1 << 22)
    device = LLM(TINY_CONFIGS[name], seed=0, kv_cache_bytes=1 << 22, attention_backend="triton", spec_method="ngram")

    expected = reference.generate(prompts, params)
    results = device.generate(prompts, params)

    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
    assert [(e.token_id, e.rank) for e in results[1].logprobs] == [(e.token_id, e.rank) for e in expected[1].logprobs]
    assert device.engine.stats().spec_decode.num_accepted_tokens > 0


class EagerReplay:
    """Stands in for a captured CUDA graph on the CPU: replaying runs the step's forward over the
    bucket's static inputs and writes into the static outputs, as a graph's replay does."""

    def __init__(self, graphs: StepGraphs, bucket, mode: str) -> None:
        self.graphs, self.bucket, self.mode = graphs, bucket, mode

    def replay(self) -> None:
        tokens, _ = self.graphs.forward(self.graphs._inputs(self.bucket), self.mode)
        self.bucket.outputs[self.mode][0].copy_(tokens)


class EagerStepGraphs(StepGraphs):
    """StepGraphs whose buckets replay eagerly: the padded static buffers, bucket choice and padding
    of the real graphs, without CUDA."""

    def _capture(self, bucket, mode: str) -> None:
        empty = StepPlan.empty()
        self.batch.prepare(empty, SchedulerOutput(), RequestStates(), pad_to=bucket.layout, out=bucket.buffer)
        bucket.outputs[mode] = self.forward(self._inputs(bucket), mode)
        bucket.graphs[mode] = EagerReplay(self, bucket, mode)


def replaying_buckets(llm: LLM) -> list[int]:
    """Give the engine's runner verify and decode buckets that replay eagerly; the list fills with
    the token count of each verify step replayed."""
    runner = llm.engine.runner
    batch, k = runner.batch, runner.max_draft_tokens
    common = {"device": runner.device, "pool": None}
    runner.graphs = EagerStepGraphs(
        batch, runner._decode_forward, decode_layouts(batch.max_rows, 1), decode_only=True, max_query_len=1, **common
    )
    runner.verify_graphs = EagerStepGraphs(
        batch,
        runner._verify_forward,
        verify_layouts(batch.max_rows, k, 1),
        decode_only=False,
        max_query_len=k + 1,
        **common,
    )
    replayed: list[int] = []
    run = runner.verify_graphs.run
    runner.verify_graphs.run = lambda plan, *rest: replayed.append(plan.num_tokens) or run(plan, *rest)
    return replayed


def forbid_host_verification(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a step of greedy or plain sampled rows was verified by the host Sampler")

    monkeypatch.setattr(model_runner, "sample_and_verify", refuse)


DEVICE_VERIFIED = {
    "greedy": [SamplingParams(temperature=0.0, max_tokens=9 + 3 * i, ignore_eos=True) for i in range(6)],
    # Seeded, with every sampling-chain setting; no history-dependent ones (they verify on the host).
    "sample": [
        SamplingParams(temperature=0.7, top_k=30, top_p=0.9, min_p=0.02, seed=11 + i, max_tokens=14, ignore_eos=True)
        for i in range(3)
    ]
    + [SamplingParams(temperature=0.0, max_tokens=15, ignore_eos=True) for _ in range(3)],
}


@CPU_ONLY
@pytest.mark.parametrize("mode", DEVICE_VERIFIED)
def test_steps_verified_on_the_device_give_the_reference_tokens_without_speculation(mode, monkeypatch):
    """Verify-only steps replay padded buckets; the steps that also hold a prompt chunk run eagerly."""
    prompts = repeating_prompts(6, seed=8)
    params = DEVICE_VERIFIED[mode]
    reference = LLM(TINY_CONFIGS["llama"], seed=0, kv_cache_bytes=1 << 22)
    device = LLM(TINY_CONFIGS["llama"], seed=0, kv_cache_bytes=1 << 22, attention_backend="triton", spec_method="ngram")
    expected = reference.generate(prompts, params)
    forbid_host_verification(monkeypatch)
    replays = replaying_buckets(device)

    results = device.generate(prompts, params)

    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
    stats = device.engine.stats().spec_decode
    assert stats.num_accepted_tokens > 0
    if mode == "greedy":
        assert stats.num_accepted_tokens < stats.num_draft_tokens  # drafts rejected too
    assert replays and max(replays) > len(prompts)  # steps with several drafts per sequence replayed
