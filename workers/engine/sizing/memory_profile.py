"""What an engine needs of a CUDA device besides its KV cache, measured with its model loaded, and
what its share of the device leaves for the KV cache:

    KV bytes = gpu_memory_utilization × the device's total memory
               − (memory outside torch's allocator + weights + peak activations + decode CUDA graphs)

- weights: the bytes of the model's parameters and buffers (this engine's own, whatever else the
  process holds).
- peak activations: measured. One synthetic step of the largest size the engine schedules runs
  through a ModelRunner of its own over a KV cache just large enough for it (profile_prompt_lengths
  says which prompts); its activations are torch's peak allocation during the step less what was
  allocated before and the temporary cache. The runner's persistent buffers (input batch, the rows'
  sampling history) are in that peak, as they will be in the engine's own runner.
- decode CUDA graphs: measured. The engine captures them after its KV cache exists, so the profile's
  runner captures the same graphs first: every batch bucket in every sampling mode, as the engine's
  pool holds them once each mode has been used. Their cost is what torch holds afterwards beyond
  what it held before, cached blocks released both times.
- outside torch's allocator (CUDA context, kernel images, library handles, graph executables):
  estimated, NON_TORCH_BYTES. vLLM reads it from torch.cuda.mem_get_info as the device's used memory
  less torch's; that is the whole device's, other processes' included, so a worker sizing its cache
  while another worker on the device loads its weights would count them as its own. Engines that
  share a process each count it, erring on the safe side.

The budget is a share of the device's total memory, not of its free memory, for the same reason:
workers sharing a device start together (manage.py serve), and the memory free when one of them
sizes its cache depends on how far the others have got. Free memory is only read to refuse, clearly,
a cache that cannot be had (check_room).
"""

import gc
import random
from dataclasses import dataclass

import torch

from workers.engine.config import EngineConfig
from workers.engine.kv.block_manager import BlockManager
from workers.engine.kv.kv_cache import KVCache
from workers.engine.kv.spec import KVCacheSpecs
from workers.engine.model_loader import LoadedModel
from workers.engine.request import Request
from workers.engine.runner.device_sampling import MODES
from workers.engine.runner.model_runner import ModelRunner
from workers.engine.sched.scheduler import Scheduler
from workers.protocol.sampling_params import MAX_LOGPROBS, SamplingParams

# CUDA context, kernel images, library handles and graph executables: an estimate with room to spare
# over a CUDA 12 context with lazy module loading (a fraction of a GiB); test_kv_sizing_cuda checks
# that it covers what the device shows for a process alone on it. NCCL's buffers (expert
# parallelism) are not counted.
NON_TORCH_BYTES = 1 << 30

# The costliest sampling: penalties (so the rows' sampling history is allocated), the whole sampling
# chain and top logprobs: device_sampling's "logprobs" mode.
PROFILE_PARAMS = SamplingParams(
    temperature=1.0, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1, logprobs=MAX_LOGPROBS, seed=0
)


def format_bytes(num_bytes: int) -> str:
    if abs(num_bytes) >= 1000 << 20:
        return f"{num_bytes / (1 << 30):.1f} GiB"
    return f"{num_bytes / (1 << 20):.1f} MiB"


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """An engine's share of a CUDA device and what it needs of it besides its KV cache, in bytes."""

    total: int  # the device's memory
    utilization: float  # the engine's fraction of it (gpu_memory_utilization)
    non_torch: int  # outside torch's allocator (estimated: NON_TORCH_BYTES)
    weights: int
    activations: int  # the largest step's peak, beyond what was allocated before it
    cuda_graphs: int  # the decode graphs' memory pool; 0 when the engine runs eagerly

    @property
    def budget(self) -> int:
        return int(self.utilization * self.total)

    def kv_bytes(self) -> int:
        """What the budget leaves for the KV cache; ValueError when it leaves nothing."""
        left = self.budget - (self.non_torch + self.weights + self.activations + self.cuda_graphs)
        if left <= 0:
            raise ValueError(
                f"gpu_memory_utilization={self.utilization:g} leaves no room for a KV cache: {self.describe()} "
                f"= {format_bytes(left)}; raise gpu_memory_utilization, or lower max_num_batched_tokens or "
                "max_num_seqs (they set the activations)"
            )
        return left

    def describe(self) -> str:
        """The arithmetic, for the log: '0.45 of 79.1 GiB − weights 15.0 GiB − ...'."""
        return (
            f"{self.utilization:g} of {format_bytes(self.total)} − weights {format_bytes(self.weights)}"
            f" − activations {format_bytes(self.activations)} − CUDA graphs {format_bytes(self.cuda_graphs)}"
            f" − outside torch {format_bytes(self.non_torch)} (estimated)"
        )


def profile_prompt_lengths(*, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> list[int]:
    """The prompts of the profiled step: max_num_batched_tokens tokens over as many requests as may
    run, so that the step samples as many rows as any step can, the first ones as long as the context
    window lets them be (the torch backends' attention grows with the square of a prompt chunk). Fewer
    tokens only when that many requests of the context window's length cannot hold them."""
    count = min(max_num_seqs, max_num_batched_tokens)
    longest = max(max_model_len - 1, 1)  # a prompt leaves the window room for the token it samples
    lengths = []
    left = max_num_batched_tokens
    for index in range(count):
        length = min(longest, left - (count - 1 - index))
        lengths.append(length)
        left -= length
    return lengths


def temporary_num_pages(lengths: list[int], page_size: int) -> int:
    """Pages the profiled step's prompts take, and the reserved page."""
    return 1 + sum(-(-length // page_size) for length in lengths)


def run_largest_step(runner: ModelRunner, lengths: list[int], *, vocab_size: int) -> int:
    """Schedule one step of prompts of these lengths (through the scheduler, as the engine does) and
    run it on `runner`, whose KV cache holds temporary_num_pages of them; the tokens it computed."""
    kv_cache = runner.kv_cache
    block_manager = BlockManager(
        num_pages=kv_cache.group_num_pages,
        page_size=kv_cache.page_size,
        enable_prefix_caching=False,
        windows=kv_cache.specs.windows,
    )
    scheduler = Scheduler(block_manager, max_num_seqs=len(lengths), max_num_batched_tokens=sum(lengths))
    tokens = random.Random(0)
    for index, length in enumerate(lengths):
        request = Request(
            request_id=f"memory-profile-{index}",
            prompt_token_ids=[tokens.randrange(vocab_size) for _ in range(length)],
            params=PROFILE_PARAMS,
            max_tokens=1,
            hash_extra=b"",
            # Prompt logprobs materialise a chunk of logits rows of their own.
            prompt_logprobs=MAX_LOGPROBS if index == 0 else None,
        )
        scheduler.add(request)
    output = scheduler.schedule()
    if sum(output.num_scheduled_tokens) != sum(lengths):
        raise RuntimeError(f"the memory profile scheduled {sum(output.num_scheduled_tokens)} of {sum(lengths)} tokens")
    runner.launch(output).result()
    return sum(output.num_scheduled_tokens)


def profile_device_memory(
    loaded: LoadedModel, config: EngineConfig, *, dtype: torch.dtype, device: torch.device
) -> DeviceMemory:
    """Measure what the engine of `config` needs of the CUDA device `device` besides its KV cache.
    What the profile allocated is released before this returns."""
    gc.collect()
    torch.cuda.empty_cache()
    _, total = torch.cuda.mem_get_info(device)
    activations, cuda_graphs = _profile_steps(loaded, config, dtype=dtype, device=device)
    # The profile's runner and its graphs refer to each other: only the collector frees them.
    gc.collect()
    torch.cuda.empty_cache()
    return DeviceMemory(
        total=total,
        utilization=config.args.gpu_memory_utilization,
        non_torch=NON_TORCH_BYTES,
        weights=_tensor_bytes(loaded.model),
        activations=activations,
        cuda_graphs=cuda_graphs,
    )


def check_room(memory: DeviceMemory, kv_bytes: int, device: torch.device) -> None:
    """RuntimeError when the device cannot give this engine what its share promises: the KV cache
    and the room the activations and graphs take after it (another engine holds more than its own
    share, or the shares add up to more than the device)."""
    free, _ = torch.cuda.mem_get_info(device)
    # Memory torch caches for this process is free to it too.
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    needed = kv_bytes + memory.activations + memory.cuda_graphs
    if needed > free:
        raise RuntimeError(
            f"gpu_memory_utilization={memory.utilization:g} gives this engine a KV cache of {format_bytes(kv_bytes)} "
            f"({memory.describe()}), which with its activations and CUDA graphs needs {format_bytes(needed)}, "
            f"but {device} has {format_bytes(free)} free: other engines or processes hold the rest. Engines "
            "sharing a device need gpu_memory_utilization fractions that add up to at most 1"
        )


def _profile_steps(
    loaded: LoadedModel, config: EngineConfig, *, dtype: torch.dtype, device: torch.device
) -> tuple[int, int]:
    """(peak activations, CUDA graphs' pool) of the engine, from a runner of the profile's own."""
    lengths = profile_prompt_lengths(
        max_num_batched_tokens=config.args.max_num_batched_tokens,
        max_num_seqs=config.args.max_num_seqs,
        max_model_len=loaded.max_model_len,
    )
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    num_pages = temporary_num_pages(lengths, config.args.page_size)
    specs = KVCacheSpecs.of_model(
        loaded.config, dtype=dtype, page_size=config.args.page_size, kv_cache_dtype=config.args.kv_cache_dtype
    )
    kv_cache = KVCache(specs, num_pages=num_pages, device=device)
    runner = ModelRunner.for_engine(
        loaded.model, kv_cache, config, max_model_len=loaded.max_model_len, enforce_eager=True
    )
    run_largest_step(runner, lengths, vocab_size=loaded.config.vocab_size)
    torch.cuda.synchronize(device)
    kv_bytes = num_pages * specs.page_bytes
    activations = torch.cuda.max_memory_allocated(device) - before - kv_bytes
    if not runner.supports_cuda_graphs or config.args.enforce_eager:
        return activations, 0
    torch.cuda.empty_cache()
    reserved = torch.cuda.memory_reserved(device)
    runner.capture_decode_graphs(modes=MODES)
    torch.cuda.synchronize(device)
    # Releases the warm-up runs' blocks; a live graph's pool keeps its own.
    torch.cuda.empty_cache()
    return activations, max(torch.cuda.memory_reserved(device) - reserved, 0)


def _tensor_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers, each storage once (tied embeddings share one)."""
    storages = {}
    for tensor in (*model.parameters(), *model.buffers()):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())
