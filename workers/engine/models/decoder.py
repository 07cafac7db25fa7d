"""The decoder over paged KV that every family serves (each family's module reads its config; see
workers.engine.models.registry): Llama's, with q/k/v biases for Qwen2, per-head RMSNorm of queries
and keys for Qwen3, and windowed layers where a config asks. Projections that read the same input
are fused (q/k/v, gate/up) so each layer runs two fewer matmuls; weights load from Hugging Face names.
The MoE families are these decoders whose sparse layers' feed-forward is a routed-experts block
(layers.moe.SparseMoeBlock): Qwen3-MoE and dots1 (DeepSeek-V3 routing) on Qwen3's attention,
Qwen2-MoE (with a gated shared expert) on Qwen2's; DeepSeek-V2/V3 route theirs behind multi-head
latent attention (models.mla), whose cache holds one latent per token. A checkpoint's per-expert
tensors are handed to that block's experts module, which stacks them (or, for expert parallelism,
keeps those it holds).

Two ways through a layer: the reference (torch ops, bitwise what the CPU tests hold against HF)
and, with `use_fused_ops(True)` on CUDA, the fused Triton ops (kernels.fused): residual add and
RMSNorm in one kernel, rotary embedding fused with the KV-cache write, SiLU·mul in one kernel, so
a decode layer is about ten kernels.
"""

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from kernels.attention import AttentionBackend, write_kv
from kernels.quant.fp8_blocks import FP8
from workers.engine.config import ModelConfig
from workers.engine.layers.fp8_linear import Fp8Linear
from workers.engine.layers.fp8_random import init_random_fp8
from workers.engine.layers.fused import fused_add_rms_norm, rms_norm, rotary_and_cache_write, silu_and_mul
from workers.engine.layers.moe import RoutedExperts, SparseMoeBlock, build_router
from workers.engine.layers.norm import RMSNorm
from workers.engine.layers.rotary import RotaryEmbedding, apply_rotary
from workers.engine.models.mla import MLAAttention
from workers.engine.models.mtp import REQUIRED_TENSORS, MultiTokenPredictor, predictor_name
from workers.engine.weights.quantization import BlockQuantized
from workers.protocol.errors import ModelLoadError

KVCache = tuple[torch.Tensor, torch.Tensor]
RotaryAngles = tuple[torch.Tensor, torch.Tensor]
# A routed expert's projection in an HF checkpoint: layer, expert, gate/up/down.
EXPERT_TENSOR = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
LAYER_TENSOR = re.compile(r"model\.layers\.(\d+)\.")


@dataclass(frozen=True, slots=True)
class InjectedEmbeddings:
    """Input embeddings computed elsewhere (an image encoder's) that replace the token embeddings of
    some of a step's tokens before the first layer: the seam through which a prefill receives them."""

    rows: torch.Tensor  # int64 [n]: indices into the step's flattened tokens
    embeddings: torch.Tensor  # [n, hidden_size], in the model's dtype and on its device


def copy_checkpoint_tensor(target: torch.Tensor, tensor: torch.Tensor | BlockQuantized, hf_name: str) -> None:
    """Copy one checkpoint tensor into its place in a model, in the place's dtype; one saved quantized
    and held unquantized here (kv_b_proj, modules_to_not_convert...) is dequantized first. Another
    shape is refused, naming the tensor."""
    if isinstance(tensor, BlockQuantized):
        tensor = tensor.dequantize(torch.float32)
    if target.shape != tensor.shape:
        raise ModelLoadError(
            f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
        )
    with torch.no_grad():
        target.copy_(tensor.to(target.dtype))


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, window: int | None) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.window = window
        self.scale = config.head_dim**-0.5
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        # Per query head, a logit in the softmax with no value (gpt-oss); None for none.
        self.sinks: nn.Parameter | None = None

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        angles: RotaryAngles | None,
        kv_cache: KVCache,
        metadata: Any,
        backend: AttentionBackend,
        rotary: RotaryEmbedding,
    ) -> torch.Tensor:
        """`angles` are the step's cos/sin for the reference path; None selects the fused kernel,
        which reads `rotary`'s tables by position itself."""
        tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden).view(tokens, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        qk, v = qkv[:, : self.num_heads + self.num_kv_heads], qkv[:, self.num_heads + self.num_kv_heads :]
        if self.q_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        k_cache, v_cache = kv_cache
        if angles is None:
            q = rotary_and_cache_write(
                qk,
                v,
                positions,
                rotary.cos,
                rotary.sin,
                k_cache,
                v_cache,
                metadata.slot_mapping,
                num_heads=self.num_heads,
            )
        else:
            # Queries and keys rotate together: one set of ops instead of two.
            q, k = apply_rotary(qk, *angles).split([self.num_heads, self.num_kv_heads], dim=1)
            write_kv(k_cache, v_cache, k, v, metadata.slot_mapping)
        out = backend(q, k_cache, v_cache, metadata, scale=self.scale, window=self.window, sinks=self.sinks)
        return self.o_proj(out.reshape(tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, *, fused: bool = False) -> torch.Tensor:
        if fused:
            return self.down_proj(silu_and_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def feed_forward(config: ModelConfig, layer: int) -> nn.Module:
    """Layer `layer`'s MLP: dense, or a sparse MoE block where the config routes that layer."""
    moe = config.moe
    if moe is None or not moe.routes(layer):
        return MLP(config.hidden_size, config.intermediate_size)
    shared = MLP(config.hidden_size, moe.shared_intermediate_size) if moe.shared_intermediate_size else None
    return SparseMoeBlock(
        build_router(moe, config.hidden_size),
        RoutedExperts(moe.num_experts, config.hidden_size, moe.intermediate_size),
        shared_expert=shared,
        shared_expert_gate=nn.Linear(config.hidden_size, 1, bias=False) if moe.shared_expert_gate else None,
    )


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = self.build_attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = self.build_feed_forward(config, layer)

    def build_attention(self, config: ModelConfig, layer: int) -> nn.Module:
        """Layer `layer`'s attention; a family whose attention differs overrides it."""
        return MLAAttention(config) if config.mla else Attention(config, config.layer_windows[layer])

    def build_feed_forward(self, config: ModelConfig, layer: int) -> nn.Module:
        """Layer `layer`'s feed-forward; a family whose experts differ overrides it."""
        return feed_forward(config, layer)

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        angles: RotaryAngles,
        kv_cache: KVCache,
        metadata: Any,
        backend: AttentionBackend,
        rotary: RotaryEmbedding,
    ) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(hidden), positions, angles, kv_cache, metadata, backend, rotary)
        hidden = hidden + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def forward_fused(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        kv_cache: KVCache,
        metadata: Any,
        backend: AttentionBackend,
        rotary: RotaryEmbedding,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The same layer with the fused ops. `hidden` is the previous layer's output not yet added
        to `residual` (None for the first layer); returns this layer's pair."""
        if residual is None:
            residual = hidden
            normed = rms_norm(hidden, self.input_layernorm.weight, self.input_layernorm.eps)
        else:
            normed = fused_add_rms_norm(hidden, residual, self.input_layernorm.weight, self.input_layernorm.eps)
        attended = self.self_attn(normed, positions, None, kv_cache, metadata, backend, rotary)
        normed = fused_add_rms_norm(
            attended, residual, self.post_attention_layernorm.weight, self.post_attention_layernorm.eps
        )
        return self.mlp(normed, fused=True), residual


class DecoderForCausalLM(nn.Module):
    # Parts a family's model may build its own way (Gemma 3's scaled embeddings, sandwich-norm layers
    # and offset norm), each constructed as the default is.
    embedding_class: ClassVar[type[nn.Embedding]] = nn.Embedding
    layer_class: ClassVar[type[nn.Module]] = DecoderLayer
    norm_class: ClassVar[type[nn.Module]] = RMSNorm

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = self.embedding_class(config.vocab_size, config.hidden_size)
        rotary_width = config.mla.qk_rope_head_dim if config.mla else config.head_dim
        self.rotary = RotaryEmbedding(config.rope, rotary_width, max_positions)
        self.layers = nn.ModuleList(self.layer_class(config, layer) for layer in range(config.num_layers))
        self.norm = self.norm_class(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (
            None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.fused_ops = False
        # The checkpoint's multi-token-prediction layers (models.mtp), where the loader is asked for them.
        self.mtp: MultiTokenPredictor | None = None

    def use_fused_ops(self, enabled: bool) -> None:
        """Run layers through the fused Triton ops (CUDA) instead of the torch reference ops."""
        self.fused_ops = enabled
        if self.mtp is not None:
            self.mtp.fused_ops = enabled

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[KVCache],
        metadata: Sequence[Any],
        backend: AttentionBackend,
        injected: InjectedEmbeddings | None = None,
    ) -> torch.Tensor:
        """Final hidden states ([tokens, hidden]) of the step's flattened tokens. `metadata`: per
        layer, the attention metadata of its KV group (kernels.attention.backend.layer_metadata).
        `injected` replaces some tokens' embeddings (a multimodal prompt's image positions)."""
        hidden = self.embed_tokens(input_ids)
        if injected is not None:
            hidden = hidden.index_copy(0, injected.rows, injected.embeddings)
        if self.fused_ops:
            residual = None
            for layer, kv_cache, layer_metadata in zip(self.layers, kv_caches, metadata, strict=True):
                hidden, residual = layer.forward_fused(
                    hidden, residual, positions, kv_cache, layer_metadata, backend, self.rotary
                )
            return fused_add_rms_norm(hidden, residual, self.norm.weight, self.norm.eps)
        angles = self.rotary.angles(positions, hidden.dtype)
        for layer, kv_cache, layer_metadata in zip(self.layers, kv_caches, metadata, strict=True):
            hidden = layer(hidden, positions, angles, kv_cache, layer_metadata, backend, self.rotary)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    def init_random_weights(self, seed: int) -> None:
        """Normal(0, initializer_range) matrices and unit norms, as HF initializes, reproducibly: the same
        weights for the same seed on every device of one type. Drawn where the parameters live (a
        GPU draws an 8B model's in a second, a CPU thread in a minute). An fp8 module's weight gets
        the values the unquantized model would hold, quantized (layers.fp8_random.init_random_fp8)."""
        generators: dict[torch.device, torch.Generator] = {}
        # The unquantized model's dtype: the embedding's, which is never quantized.
        dtype = self.embed_tokens.weight.dtype
        with torch.no_grad():
            for name, param in self.named_parameters():
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                elif name.endswith(".bias"):
                    param.zero_()
                else:
                    device = param.device
                    if device not in generators:
                        generators[device] = torch.Generator(device=device).manual_seed(seed)
                    if param.dtype == FP8:
                        module, _, weight = name.rpartition(".")
                        std = self.config.initializer_range
                        init_random_fp8(self.get_submodule(module), weight, generators[device], std, dtype)
                    else:
                        values = torch.randn(param.shape, generator=generators[device], device=device)
                        param.copy_((values * self.config.initializer_range).to(param.dtype))
        if self.mtp is not None:
            self.mtp.share_main_weights(self, loaded=())

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | BlockQuantized]]) -> None:
        """Copy Hugging Face-named tensors into the fused layout; every parameter must be covered. A
        tensor saved quantized goes as it is to an fp8 module (workers.engine.fp8_model), dequantized
        to any other."""
        # Parameters and persistent buffers (a router's correction bias), sharing their storage.
        params = self.state_dict()
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            if self._skipped_mtp_layer(hf_name):
                continue
            expert = EXPERT_TENSOR.fullmatch(hf_name)
            if expert is not None:
                self._load_expert_weight(hf_name, expert, tensor)
                loaded.add(hf_name)
                continue
            target = _map_hf_name(hf_name, self.config)
            if target is None:
                continue
            name, offset = predictor_name(target[0], self.config.num_layers), target[1]
            module_name, _, param_name = name.rpartition(".")
            fp8 = modules.get(module_name)
            if isinstance(fp8, Fp8Linear) and param_name == "weight":
                fp8.load_rows(offset or 0, tensor, hf_name)
                loaded.add(hf_name)
                continue
            if name not in params:
                raise ModelLoadError(f"checkpoint tensor {hf_name!r} has no place in this model")
            param = params[name]
            copy_checkpoint_tensor(
                param.data[offset : offset + tensor.shape[0]] if offset is not None else param.data, tensor, hf_name
            )
            loaded.add(hf_name)
        missing = sorted(self.expected_hf_names() - loaded)
        if missing:
            raise ModelLoadError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
        if self.mtp is not None:
            missing = sorted(_expected_mtp_names(self.config) - loaded)
            if missing:
                raise ModelLoadError(
                    f"the config's num_nextn_predict_layers={self.config.mtp_layers} declares multi-token-prediction "
                    f"layers whose tensors the checkpoint lacks: {len(missing)} of them, e.g. {missing[:3]}"
                )
            self.mtp.share_main_weights(self, loaded)

    def expected_hf_names(self) -> set[str]:
        """The checkpoint tensors this model needs, by their Hugging Face names (its MTP layers' aside)."""
        return _expected_hf_names(self.config)

    def _skipped_mtp_layer(self, hf_name: str) -> bool:
        """A tensor of a multi-token-prediction layer (ModelConfig.mtp_layers) when none is built."""
        layer = LAYER_TENSOR.match(hf_name)
        num_layers = self.config.num_layers
        return (
            self.mtp is None and layer is not None and num_layers <= int(layer[1]) < num_layers + self.config.mtp_layers
        )

    def _decoder_layer(self, layer: int) -> nn.Module | None:
        """The checkpoint's decoder layer `layer`: one of ours, or an MTP layer's block."""
        if layer < len(self.layers):
            return self.layers[layer]
        if self.mtp is not None and layer in self.mtp.checkpoint_layers:
            return self.mtp.layers[layer - self.mtp.first_layer].block
        return None

    def _load_expert_weight(self, hf_name: str, match: re.Match, tensor: torch.Tensor) -> None:
        layer, expert, projection = int(match[1]), int(match[2]), match[3]
        decoder_layer = self._decoder_layer(layer)
        mlp = decoder_layer.mlp if decoder_layer is not None else None
        if not isinstance(mlp, SparseMoeBlock):
            raise ModelLoadError(f"checkpoint tensor {hf_name!r} has no place in this model: layer {layer} is dense")
        if isinstance(tensor, BlockQuantized) and not isinstance(mlp.experts, RoutedExperts):
            tensor = tensor.dequantize(torch.float32)
        mlp.experts.load_expert_weight(expert, projection, tensor)


def _map_hf_name(hf_name: str, config: ModelConfig) -> tuple[str, int | None] | None:
    """Our parameter name and row offset for an HF tensor name; None for tensors we do not use."""
    name = hf_name.removeprefix("model.")
    if name == "lm_head.weight" and config.tie_word_embeddings:
        return None
    if ".rotary_emb." in name:
        return None
    q_size = config.num_heads * config.head_dim
    kv_size = config.num_kv_heads * config.head_dim
    # dots1 and DeepSeek name their shared experts in the plural; one fused MLP serves them either way.
    name = name.replace(".mlp.shared_experts.", ".mlp.shared_expert.")
    shared_size = config.moe.shared_intermediate_size if config.moe is not None else 0
    fused = {
        "self_attn.q_proj.": ("self_attn.qkv_proj.", 0),
        "self_attn.k_proj.": ("self_attn.qkv_proj.", q_size),
        "self_attn.v_proj.": ("self_attn.qkv_proj.", q_size + kv_size),
        "mlp.gate_proj.": ("mlp.gate_up_proj.", 0),
        "mlp.up_proj.": ("mlp.gate_up_proj.", config.intermediate_size),
        "mlp.shared_expert.gate_proj.": ("mlp.shared_expert.gate_up_proj.", 0),
        "mlp.shared_expert.up_proj.": ("mlp.shared_expert.gate_up_proj.", shared_size),
        # A sparse layer's router (weight and correction bias) is HF's `mlp.gate`.
        "mlp.gate.": ("mlp.router.", None),
    }
    for part, (replacement, offset) in fused.items():
        if part in name and not (config.mla and part.startswith("self_attn.")):
            return name.replace(part, replacement), offset
    return name, None


def _expected_hf_names(config: ModelConfig) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config.tie_word_embeddings:
        names.add("lm_head.weight")
    for i in range(config.num_layers):
        names.update(_expected_layer_names(config, i))
    return names


def _expected_mtp_names(config: ModelConfig) -> set[str]:
    """An MTP layer's own tensors but its embedding and head, which may be left to the main model's,
    and its decoder layer's."""
    names = set()
    for i in range(config.num_layers, config.num_layers + config.mtp_layers):
        names.update(f"model.layers.{i}.{name}" for name in REQUIRED_TENSORS)
        names.update(_expected_layer_names(config, i))
    return names


def _expected_layer_names(config: ModelConfig, layer: int) -> set[str]:
    """Decoder layer `layer`'s tensors."""
    per_layer = ["input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.o_proj.weight"]
    if config.mla is not None:
        per_layer += _expected_mla_names(config)
    else:
        per_layer += ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"]
    if config.attention_bias:
        per_layer += ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]
    if config.qk_norm:
        per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    dense = ["mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
    sparse = config.moe is not None and config.moe.routes(layer)
    feed_forward = _expected_moe_names(config) if sparse else dense
    return {f"model.layers.{layer}.{p}" for p in per_layer + feed_forward}


def _expected_mla_names(config: ModelConfig) -> list[str]:
    names = ["kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "kv_b_proj.weight"]
    if config.mla.q_lora_rank is None:
        names.append("q_proj.weight")
    else:
        names += ["q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight"]
    return [f"self_attn.{name}" for name in names]


def _expected_moe_names(config: ModelConfig) -> list[str]:
    moe = config.moe
    names = ["mlp.gate.weight"]
    names += [f"mlp.experts.{e}.{p}_proj.weight" for e in range(moe.num_experts) for p in ("gate", "up", "down")]
    if moe.routing == "grouped_sigmoid":
        names.append("mlp.gate.e_score_correction_bias")
    if moe.shared_intermediate_size:
        # Qwen2-MoE, whose shared expert is gated, names it in the singular; dots1 and DeepSeek in the plural.
        shared = "shared_expert" if moe.shared_expert_gate else "shared_experts"
        names += [f"mlp.{shared}.{p}_proj.weight" for p in ("gate", "up", "down")]
    if moe.shared_expert_gate:
        names.append("mlp.shared_expert_gate.weight")
    return names
