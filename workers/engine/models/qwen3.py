"""Qwen3 (dense): Llama's decoder with per-head RMSNorm of queries and keys."""

from workers.engine.models.family import DecoderFamily


class Qwen3(DecoderFamily):
    name = "qwen3"
    qk_norm = True
