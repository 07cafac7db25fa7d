"""Mistral: Llama's decoder, every layer windowed when the config sets sliding_window (HF's Mistral
ignores layer_types, max_window_layers and attention_bias)."""

from typing import Any

from workers.engine.config import ModelConfig
from workers.engine.models.family import DecoderFamily
from workers.protocol.errors import ModelLoadError

# HF's MistralConfig windows by default: a config that does not name sliding_window gets this one.
DEFAULT_SLIDING_WINDOW = 4096


class Mistral(DecoderFamily):
    name = "mistral"

    def model_config(self, hf: dict[str, Any]) -> ModelConfig:
        hidden_act = hf.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ModelLoadError(f"unsupported hidden_act {hidden_act!r} for Mistral; supported: silu")
        return super().model_config(hf)

    def attention_bias(self, hf: dict[str, Any]) -> bool:
        return False

    def layer_windows(self, hf: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
        window = hf.get("sliding_window", DEFAULT_SLIDING_WINDOW)
        if window is None:
            return (None,) * num_layers
        if int(window) < 1:
            raise ModelLoadError(f"sliding_window must be positive or null, got {window!r}")
        return (int(window),) * num_layers
