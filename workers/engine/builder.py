"""EngineArgs → one ready LLMEngine: the model (weights, or random from a config), the engine's
resolved config (torch dtype, loaded cost model), and the KV store. Every rank of an EPEngine builds
its engine here; workers.engine.factory chooses between an LLMEngine and an EPEngine."""

import os
from pathlib import Path

import torch

from workers.args import EngineArgs
from workers.cost_model import PrefillCostModel
from workers.engine.config import EngineConfig
from workers.engine.engine import ConstraintCompiler, LLMEngine
from workers.engine.layers.moe import RoutedExperts
from workers.engine.model_loader import ModelSource, load_model
from workers.engine.spec.draft_model import DraftModelDrafter, check_draft_model, draft_engine_args
from workers.kvstore.store import open_store
from workers.protocol.errors import ModelLoadError
from workers.text.tokenizer import Tokenizer


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
        quantization=args.quantization,
        with_mtp=args.spec_method == "mtp",
    )
    if args.ep_size > 1 and any(isinstance(m, RoutedExperts) and m.quantized for m in loaded.model.modules()):
        # Expert-parallel ranks move stacked expert weights between devices without their scales.
        raise ModelLoadError("ep_size > 1 does not serve fp8 experts on CUDA yet (quantization / an fp8 checkpoint)")
    store = open_store(Path(args.kv_store), args.kv_store_index) if args.kv_store else None
    drafter = None
    if args.spec_method == "draft":
        drafter = build_draft_drafter(
            args.spec_draft_model,
            args,
            tokenizer=loaded.tokenizer,
            vocab_size=loaded.config.vocab_size,
            max_model_len=loaded.max_model_len,
        )
    return LLMEngine(loaded, config, store, compile_constraint=compile_constraint, drafter=drafter)


def build_draft_drafter(
    draft_model: ModelSource | None,
    target: EngineArgs,
    *,
    tokenizer: Tokenizer | None,
    vocab_size: int,
    max_model_len: int,
) -> DraftModelDrafter:
    """The draft-model drafter of an engine built from `target`, whose model reads `vocab_size` ids
    with `tokenizer` over `max_model_len` tokens: the draft model in an engine of its own; ModelLoadError
    naming spec_draft_model for one that cannot draft for it (none given, another tokenizer or
    vocabulary size)."""
    engine = build_rank_engine(draft_engine_args(draft_model, target, max_model_len))
    info = engine.info
    check_draft_model(
        info.model_name,
        info.model_config.vocab_size,
        info.tokenizer,
        target_vocab_size=vocab_size,
        target_tokenizer=tokenizer,
    )
    return DraftModelDrafter(engine)


def engine_config(args: EngineArgs) -> EngineConfig:
    return EngineConfig(args, cost_model=_cost_model(args.cost_model))


def _cost_model(source: str | os.PathLike | PrefillCostModel | None) -> PrefillCostModel | None:
    if not source or isinstance(source, PrefillCostModel):
        return source or None
    return PrefillCostModel.load(Path(source))
