"""Which parts of a built model hold FP8 weights, turning them into fp8 modules
(layers.fp8_linear.Fp8Linear, RoutedExperts.use_fp8) before their weights exist (the model is built on
the meta device: workers.engine.materialize); layers.fp8_random draws random weights into them.

Quantized: the decoder layers' linear projections and routed experts, a multi-token-prediction
layer's (models.mtp) as well: its decoder layer's and its eh_proj. Kept in the model's dtype, as
DeepSeek-V3's checkpoint keeps them: embeddings, norms, lm_head and an MTP layer's shared_head.head,
routers (not nn.Linear modules) and Qwen2-MoE's shared-expert gate, plus MLA's kv_b_proj, which
attention uses only in absorbed form (views of its weight multiplied per head, models.mla): a
checkpoint's e4m3 kv_b_proj is dequantized at load into the model's dtype rather than quantizing
those products.

A checkpoint saved in FP8 decides which of these it quantized: a part is converted only if every
weight it holds (each of a fused projection's parts, each expert's) is saved in e4m3 and none is in
modules_to_not_convert; any other e4m3 weight is dequantized into the model's dtype as it loads
(DeepSeek-V3 saves its MTP layer's decoder layer in e4m3, its eh_proj in bf16). --quantization fp8 on
a float checkpoint converts every one.
"""

import torch
from torch import nn

from workers.engine.layers.fp8_linear import Fp8Linear
from workers.engine.layers.moe import EXPERT_PROJECTIONS, RoutedExperts
from workers.engine.models.mtp import checkpoint_name
from workers.engine.weights.quantization import Fp8Format

# "head": an MTP layer's shared_head.head, an output head like lm_head.
KEPT_IN_MODEL_DTYPE = frozenset({"kv_b_proj", "shared_expert_gate", "head"})
# Our fused projections and the HF modules they stack.
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def convert_to_fp8(model: nn.Module, fmt: Fp8Format, *, saved_fp8: frozenset[str] | None = None) -> None:
    """Replace the quantizable parts of `model` (on the meta device, its weights still to load or
    draw) by fp8 ones. `saved_fp8`: the checkpoint's tensors saved in e4m3; only a part whose every
    weight is one is converted (None: every part)."""
    for name, module in list(model.named_modules()):
        # An MTP layer's modules under the checkpoint's names: model.layers.L past the served layers.
        checkpoint = checkpoint_name(name, model.config.num_layers)
        if not checkpoint.startswith("layers.") or not all(fmt.converts(hf) for hf in hf_module_names(checkpoint)):
            continue
        if saved_fp8 is not None and not _saved_in_fp8(checkpoint, module, saved_fp8):
            continue
        if isinstance(module, RoutedExperts):
            module.use_fp8(fmt.block)
        elif type(module) is nn.Linear and name.rpartition(".")[2] not in KEPT_IN_MODEL_DTYPE:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, Fp8Linear.like(module, fmt.block))


def finish_fp8_loading(model: nn.Module, dtype: torch.dtype) -> None:
    """After every weight is in: fp8 modules quantize what they assembled in float32, and off CUDA
    dequantize into `dtype` for the reference path."""
    for module in model.modules():
        if isinstance(module, Fp8Linear | RoutedExperts):
            module.finish_loading(dtype)


def hf_module_names(name: str) -> list[str]:
    """The HF modules whose weights our module `name` (its layer numbered as the checkpoint's) holds
    (a fused projection's parts; a shared expert under the singular name Qwen2-MoE uses or the plural
    that DeepSeek and dots1 use)."""
    parent, _, child = f"model.{name}".rpartition(".")
    names = [f"{parent}.{part}" for part in FUSED_PARTS.get(child, (child,))]
    return [
        spelling
        for hf in names
        for spelling in ([hf, hf.replace(".shared_expert.", ".shared_experts.")] if ".shared_expert." in hf else [hf])
    ]


def _saved_in_fp8(name: str, module: nn.Module, saved_fp8: frozenset[str]) -> bool:
    if isinstance(module, RoutedExperts):
        experts = f"model.{name}"
        return all(
            f"{experts}.{expert}.{projection}_proj.weight" in saved_fp8
            for expert in range(module.w13.shape[0])
            for projection in EXPERT_PROJECTIONS
        )
    child = name.rpartition(".")[2]
    # hf_module_names spells a shared expert's parts two ways, of which a checkpoint uses one.
    saved = sum(f"{hf}.weight" in saved_fp8 for hf in hf_module_names(name))
    return saved == len(FUSED_PARTS.get(child, (child,)))
