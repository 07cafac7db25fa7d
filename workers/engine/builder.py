"""EngineArgs → a ready engine: the model (weights, or random from a config), the engine's resolved
config (torch dtype, loaded cost model), and the KV store. The offline LLM and the worker both build
their engine here: an LLMEngine, or with ep_size > 1 an EPEngine (workers.engine.parallel), whose
ranks each build an LLMEngine with build_rank_engine."""

import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from workers.args import EngineArgs
from workers.cost_model import PrefillCostModel
from workers.engine.config import EngineConfig
from workers.engine.engine import LLMEngine
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


def build_rank_engine(args: EngineArgs) -> LLMEngine:
    """One LLMEngine for `args`, whatever their ep_size: an EP rank's own engine."""
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
    return LLMEngine(loaded, config, store)


def engine_config(args: EngineArgs) -> EngineConfig:
    return EngineConfig(args, cost_model=_cost_model(args.cost_model))


def _cost_model(source: str | os.PathLike | PrefillCostModel | None) -> PrefillCostModel | None:
    if not source or isinstance(source, PrefillCostModel):
        return source or None
    return PrefillCostModel.load(Path(source))
