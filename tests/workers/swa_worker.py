"""`python -m tests.workers.swa_worker <worker options>`: the real worker process, with a stand-in for the
engine's side of the SWA state, which is not wired to the worker yet: every full block of the prompt a
GenerateRequest brings is kept (SwaStateHolder.kept) as soon as the request arrives, as the engine will
keep the blocks it computes, with a run made from the block's key (`stand_in_run`), so that a test knows
what a fetch of it must bring."""

import sys

import torch

from workers.kvstore.block_hash import BlockHash, hash_chain, namespace_extra
from workers.protocol.messages import GenerateRequest
from workers.worker.process import main
from workers.worker.server import Worker


def stand_in_run(key: BlockHash, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") >> 1)
    return torch.randn(shape, generator=generator).to(dtype)


def prompt_keys(request: GenerateRequest, kv_model_id: str, block_tokens: int) -> list[BlockHash]:
    """The keys of the prompt's full blocks."""
    return hash_chain(request.prompt_token_ids, block_tokens, namespace_extra(kv_model_id, request.cache_namespace))


def _keep_prompts() -> None:
    on_generate = Worker._on_generate

    def keeping(self: Worker, peer: bytes, request: GenerateRequest) -> None:
        on_generate(self, peer, request)
        if self.swa is not None:
            cache = self.swa.cache
            keys = prompt_keys(request, self.engine.info.kv_model_id, cache.block_tokens)
            self.swa.kept(keys, [stand_in_run(key, cache.run_shape, cache.spec.dtype) for key in keys])

    Worker._on_generate = keeping


if __name__ == "__main__":
    _keep_prompts()
    main(sys.argv[1:])
