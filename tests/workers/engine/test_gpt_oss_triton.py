"""gpt-oss through the Triton attention kernels (sinks, windows) against Hugging Face: a chunk of
prefill, then a decode step. Without CUDA the kernels run in Triton's interpreter on the CPU."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated, so set it first
pytest.importorskip("triton")

from kernels.attention import DeviceStepTensors, get_backend  # noqa: E402
from tests.workers.engine.hf_gpt_oss_reference import build_hf_gpt_oss  # noqa: E402
from workers.engine.kv.kv_cache import KVCache  # noqa: E402
from workers.engine.models.gpt_oss import GptOssForCausalLM  # noqa: E402
from workers.engine.models.registry import model_config  # noqa: E402

PAGE = 16


def step(query_len: int, seq_len: int, table: list[int], device: torch.device) -> DeviceStepTensors:
    """One sequence's step: its last `query_len` of `seq_len` tokens."""
    positions = torch.arange(seq_len - query_len, seq_len)
    pages = torch.tensor(table)[positions // PAGE]
    return DeviceStepTensors(
        positions=positions.to(device),
        slot_mapping=(pages * PAGE + positions % PAGE).to(device),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32, device=device),
        query_start=torch.tensor([0, query_len], dtype=torch.int32, device=device),
        block_tables=torch.tensor([table], dtype=torch.int32, device=device),
        max_query_len=query_len,
        decode_only=query_len == 1,
    )


def test_prefill_then_decode_match_hf():
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    hf_model = build_hf_gpt_oss()
    config = model_config(hf_model.config.to_dict())
    model = GptOssForCausalLM(config, max_positions=256).eval()
    model.load_weights(hf_model.state_dict().items())
    model.to(device)
    tokens = torch.randint(0, config.vocab_size, (21,), generator=torch.Generator().manual_seed(1))
    kv = KVCache.for_model(config, num_pages=5, page_size=PAGE, dtype=torch.float32, device=device)
    table, backend = [3, 1], get_backend("triton")
    with torch.no_grad():
        expected = hf_model(tokens[None]).logits[0]
        ours = []
        for start, end in ((0, 20), (20, 21)):  # a prefill chunk, then one decode step
            metadata = step(end - start, end, table, device)
            hidden = model(
                tokens[start:end].to(device), metadata.positions, kv.layers, [metadata] * len(kv.layers), backend
            )
            ours.append(model.compute_logits(hidden).cpu())
    torch.testing.assert_close(torch.cat(ours), expected, atol=1e-4, rtol=1e-4)
