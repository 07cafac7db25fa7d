"""Qwen2 (dense): Llama's decoder with q/k/v biases."""

from typing import Any

from workers.engine.models.family import DecoderFamily


class Qwen2(DecoderFamily):
    name = "qwen2"

    def attention_bias(self, hf: dict[str, Any]) -> bool:
        # Qwen2 always has q/k/v biases; its config does not say so.
        return bool(hf.get("attention_bias", True))
