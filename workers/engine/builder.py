"""EngineArgs → a ready engine: the model (weights, or random from a config), the engine's resolved
config (torch dtype, loaded cost model), and the KV store. The offline LLM and the worker both build
their engine here: an LLMEngine, or with ep_size > 1 an EPEngine (workers.engine.parallel), whose
ranks each build an LLMEngine with build_rank_engine."""

import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from workers.args import EngineArgs, torch_dtype
from workers.cost_model import PrefillCostModel
from workers.engine.config import EngineConfig
from workers.engine.engine import ConstraintCompiler, LLMEngine
from workers.engine.model_loader import load_model
from workers.kvstore.store import open_store

if TYPE_CHECKING:
    from workers.engine.parallel.ep_engine import EPEngine


def build_engine(args: EngineArgs) -> "LLMEngine | EPEngine":
    """Settings that cannot work (a cost model that cannot be read) fail before the model loads."""
    if args.ep_size > 1:
        from workers.engine.parallel.ep_engine import EPEngine

        return EPEngine(args)
    return build_rank_engine(args)


def build_rank_engine(args: EngineArgs, compile_constraint: ConstraintCompiler | None = None) -> LLMEngine:
    """One LLMEngine for `args`, whatever their ep_size: an EP rank's own engine. `compile_constraint`
    is the engine's (LLMEngine's default without it)."""
    config = engine_config(args)
    loaded = load_model(
        args.model,
        device=torch.device(args.device),
        dtype=config.dtype,
        seed=args.seed,
        max_model_len=args.max_model_len,
        tokenizer=args.tokenizer,
    )
    store = open_store(Path(args.kv_store), args.kv_store_index) if args.kv_store else None
    return LLMEngine(loaded, config, store, compile_constraint=compile_constraint)


def engine_config(args: EngineArgs) -> EngineConfig:
    return EngineConfig(
        device=args.device,
        dtype=torch_dtype(args.dtype) if args.dtype else None,
        attention_backend=args.attention_backend,
        page_size=args.page_size,
        num_pages=args.num_pages,
        kv_cache_bytes=args.kv_cache_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
        kv_block_tokens=args.kv_block_tokens,
        kv_store_max_retained_tokens=args.kv_store_max_retained_tokens,
        kv_store_max_retention_s=args.kv_store_max_retention_s,
        seed=args.seed,
        max_waiting=args.max_waiting,
        cost_model=_cost_model(args.cost_model),
        step_budget_s=args.step_budget_ms / 1000 if args.step_budget_ms is not None else None,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        kv_transfer=args.kv_transfer,
    )


def _cost_model(source: str | os.PathLike | PrefillCostModel | None) -> PrefillCostModel | None:
    if not source or isinstance(source, PrefillCostModel):
        return source or None
    return PrefillCostModel.load(Path(source))
