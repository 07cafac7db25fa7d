"""The NCCL path on one GPU: a single-rank NCCL group carries ExpertParallelExperts' dispatch and
combine, equal to kernels.moe.experts, and an EPEngine of one rank serves the tiny Qwen3-MoE with
the greedy tokens of a plain engine."""

import pytest
import torch

from kernels.moe import experts
from tests.workers.engine.expert_parallel.tiny_moe import QWEN3_MOE
from workers.args import EngineArgs
from workers.engine import LLM, SamplingParams
from workers.engine.expert_parallel import ep_engine
from workers.engine.expert_parallel.ep_engine import EPEngine
from workers.engine.parallel.experts import ExpertParallelExperts
from workers.engine.parallel.groups import Rendezvous, join_group
from workers.protocol.engine_request import EngineRequest

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
PROMPTS = [[3, 14, 15, 92, 65], list(range(40, 80))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.mark.gpu
@requires_cuda
def test_a_single_rank_nccl_group_dispatches_and_combines():
    cuda = torch.device("cuda")
    rendezvous = Rendezvous.open(1)
    group = join_group(rank=0, size=1, port=rendezvous.port, device=cuda, rendezvous=rendezvous)
    try:
        assert group.process_group is not None  # NCCL even for one rank
        generator = torch.Generator().manual_seed(0)
        w13 = (torch.randn(16, 128, 256, generator=generator) * 0.05).to(torch.bfloat16)
        w2 = (torch.randn(16, 256, 64, generator=generator) * 0.05).to(torch.bfloat16)
        placement = [list(range(16)) + [0, 1, 2, 3]]  # four redundant slots
        layer = ExpertParallelExperts(
            group=group, host_w13=w13, host_w2=w2, placement=placement, top_k=4, compute=experts
        )
        hidden = torch.randn(300, 256, generator=generator).to(torch.bfloat16).to(cuda)
        weights, ids = torch.randn(300, 16, generator=generator).softmax(-1).topk(4, dim=-1)
        expected = experts(hidden, w13.to(cuda), w2.to(cuda), ids.to(cuda), weights.to(cuda))
        got = layer(hidden, ids.to(cuda), weights.to(cuda))
        torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)
        assert layer.take_load().sum().item() == 300 * 4
    finally:
        group.destroy()


@pytest.mark.gpu
@requires_cuda
def test_an_ep_engine_of_one_gpu_rank_serves_the_plain_engines_tokens(monkeypatch):
    monkeypatch.setattr(ep_engine, "LOAD_INTERVAL_S", 0.0)  # counters read at every step
    settings = dict(seed=0, device="cuda", kv_cache_bytes=1 << 24)
    expected = LLM(QWEN3_MOE, **settings, enforce_eager=True).generate(PROMPTS, GREEDY)
    engine = EPEngine(EngineArgs(model=QWEN3_MOE, **settings))
    try:
        tokens = {f"g{i}": [] for i in range(len(PROMPTS))}
        for request_id, prompt in zip(tokens, PROMPTS, strict=True):
            engine.add_request(EngineRequest(request_id=request_id, prompt_token_ids=prompt, params=GREEDY))
        while engine.has_unfinished():
            for delta in engine.step():
                tokens[delta.request_id] += delta.token_ids
        assert list(tokens.values()) == [r.token_ids for r in expected]
        load = engine.take_expert_load()
        assert len(load) == 2 and sum(map(sum, load)) > 0
    finally:
        engine.close()
