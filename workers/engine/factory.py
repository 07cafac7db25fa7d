"""EngineArgs → the engine the offline LLM and the worker serve: an LLMEngine, or with ep_size > 1 an
EPEngine (workers.engine.parallel), whose ranks each build an LLMEngine (workers.engine.builder).
Above both, so neither imports the other's chooser."""

from workers.args import EngineArgs
from workers.engine.builder import build_rank_engine
from workers.engine.engine import LLMEngine
from workers.engine.expert_parallel.ep_engine import EPEngine


def build_engine(args: EngineArgs) -> LLMEngine | EPEngine:
    """Settings that cannot work (a cost model that cannot be read) fail before the model loads."""
    if args.ep_size > 1:
        return EPEngine(args)
    return build_rank_engine(args)
