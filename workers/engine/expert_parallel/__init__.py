"""The expert-parallel engine: one EngineCore (EPEngine) over N rank processes, each an LLMEngine whose
MoE layers hold a share of the experts (workers.engine.parallel), stepping in lockstep."""
