"""Which family serves a Hugging Face architecture: the one that reads its config and builds its model."""

from typing import Any

from workers.engine.config import ModelConfig
from workers.engine.models.deepseek import DeepseekV2, DeepseekV3
from workers.engine.models.dots1 import Dots1
from workers.engine.models.family import DecoderFamily
from workers.engine.models.gemma3 import Gemma3
from workers.engine.models.gpt_oss import GptOss
from workers.engine.models.idefics3 import Idefics3
from workers.engine.models.llama import Llama
from workers.engine.models.mistral import Mistral
from workers.engine.models.qwen2 import Qwen2
from workers.engine.models.qwen3 import Qwen3
from workers.engine.models.qwen_moe import Qwen2Moe, Qwen3Moe
from workers.protocol.errors import ModelLoadError

ARCHITECTURES: dict[str, DecoderFamily] = {
    "LlamaForCausalLM": Llama(),
    "Qwen2ForCausalLM": Qwen2(),
    "Qwen3ForCausalLM": Qwen3(),
    "Qwen3MoeForCausalLM": Qwen3Moe(),
    "Qwen2MoeForCausalLM": Qwen2Moe(),
    "Dots1ForCausalLM": Dots1(),
    "DeepseekV2ForCausalLM": DeepseekV2(),
    "DeepseekV3ForCausalLM": DeepseekV3(),
    "GptOssForCausalLM": GptOss(),
    "Gemma3ForCausalLM": Gemma3(),
    "MistralForCausalLM": Mistral(),
    # SmolVLM is Idefics3's architecture under its own name.
    "Idefics3ForConditionalGeneration": Idefics3(),
    "SmolVLMForConditionalGeneration": Idefics3(),
}


def family_of(hf: dict[str, Any]) -> DecoderFamily:
    """The family of the first architecture a Hugging Face config names that one serves."""
    architectures = hf.get("architectures") or []
    family = next((ARCHITECTURES[a] for a in architectures if a in ARCHITECTURES), None)
    if family is None:
        raise ModelLoadError(
            f"unsupported architecture {architectures or hf.get('model_type')!r}; supported: {sorted(ARCHITECTURES)}"
        )
    return family


def model_config(hf: dict[str, Any]) -> ModelConfig:
    """The decoder shape of a Hugging Face config dict, checked for consistency."""
    return family_of(hf).model_config(hf)
