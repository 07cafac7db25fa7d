"""DeepSeek-V3's multi-token-prediction (MTP) layers, which its checkpoints hold past num_hidden_layers
(num_nextn_predict_layers of them; V3 ships one, layer 61): a drafter for speculative decoding.

MTP layer k at position i (DeepSeek-V3 technical report, section 2.2), from the main model's final
hidden state h_i and the next token t_{i+1}:

    h'_i     = eh_proj([enorm(Emb(t_{i+1})); hnorm(h_i)])    # 2 * hidden -> hidden, no bias
    h''      = TransformerBlock_k(h')                         # a decoder layer: MLA with its own KV, MoE
    out_i    = shared_head.norm(h''_i)
    logits_i = shared_head.head(out_i)                        # predicts t_{i+2}

Where the report is not explicit, what this follows:
- The concatenation is the normed embedding first, then the normed hidden state: vLLM's
  models/deepseek_mtp.py and SGLang's models/deepseek_nextn.py both concatenate
  (enorm(embedding), hnorm(hidden)).
- h_i is the main model's final hidden state after its final norm: the tensor
  DecoderForCausalLM.forward returns and lm_head reads. vLLM and SGLang feed that one, and the
  modeling_deepseek.py DeepSeek ships with its MTP checkpoints hands the normed output to the MTP
  layer (cited in ROCm/ATOM PR 1764). Not the last layer's output before that norm.
- A chained draft step feeds the previous step's out_i (after shared_head.norm) as its h, as
  SGLang does and vLLM since PR 45895; so `forward` returns out_i and `compute_logits` only projects.
- vLLM zeroes the embedding at position 0; neither the report nor SGLang does, nor do we.
- Emb and shared_head.head: a layer's own copies where the checkpoint holds them
  (model.layers.L.embed_tokens / shared_head.head; DeepSeek-V3's equal the main model's embedding and
  lm_head, and cost 2 x vocab x hidden more memory), else the main model's, shared.

Its transformer block is the main model's layer class built at index L, so MLA, the experts and FP8
(workers.engine.fp8_model) apply to it as to any layer. Its KV: one latent per position per MTP layer,
at the same slots as the main model's (`kv_cache_spec`).

Drafting K tokens after the main model computed positions 0..n-1 (final hidden states h) and sampled
t_n (test_mtp's chained-steps test runs exactly this):
- step 1: out = mtp(h, [t_1..t_n], positions 0..n-1, ...) over the positions the MTP layer has not
  seen yet (a prefill: all; a decode: the newly accepted ones), metadata as for those positions'
  query rows; d_1 = sample(mtp.compute_logits(out[last])).
- step s = 2..K: out = mtp(out[last], [d_{s-1}], position n+s-2, ...), one query row per request
  whose sequence length is n+s-1 in the MTP layer's KV; d_s from its logits.
A draft step writes the MTP layer's latent at its position's slot; after verification, the accepted
positions' are rewritten from the main model's hidden states in the next round's step 1. With several
MTP layers, step s would use layer (s-1) % num_nextn_predict_layers, as vLLM does.
"""

import re
from collections.abc import Collection

import torch
import torch.nn.functional as F
from torch import nn

from kernels.attention import AttentionBackend
from workers.engine.config import ModelConfig
from workers.engine.kv.spec import KVCacheSpec, latent
from workers.engine.layers.fused import fused_add_rms_norm
from workers.engine.layers.norm import RMSNorm
from workers.protocol.errors import ModelLoadError

# An MTP layer's own parts, under its checkpoint prefix model.layers.L.; the rest is its decoder layer's.
OWN_PARTS = ("embed_tokens.", "enorm.", "hnorm.", "eh_proj.", "shared_head.")
# Those the checkpoint must hold; the embedding and the head may be left to the main model's.
REQUIRED_TENSORS = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")
LAYER = re.compile(r"layers\.(\d+)\.")
PREDICTOR_LAYER = re.compile(r"mtp\.layers\.(\d+)\.(block\.)?")


class SharedHead(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)


class MtpLayer(nn.Module):
    def __init__(self, config: ModelConfig, block: nn.Module) -> None:
        super().__init__()
        # The checkpoint's names under model.layers.L., so that they load by name.
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.block = block
        self.shared_head = SharedHead(config)


class MultiTokenPredictor(nn.Module):
    """A model's MTP layers. Built from the main model (DecoderForCausalLM), whose layer class, rotary
    tables and fused-ops choice it shares; held as the main model's `mtp`."""

    def __init__(self, main: nn.Module) -> None:
        super().__init__()
        config: ModelConfig = main.config
        if not config.mtp_layers:
            raise ModelLoadError(
                "multi-token prediction (spec_method 'mtp') was asked of a model whose config has no MTP layers "
                "(num_nextn_predict_layers is 0 or absent; DeepSeek-V3's checkpoints hold one)"
            )
        self.config = config
        self.first_layer = config.num_layers
        self.layers = nn.ModuleList(
            MtpLayer(config, main.layer_class(config, layer)) for layer in self.checkpoint_layers
        )
        self.rotary = main.rotary
        self.fused_ops = main.fused_ops

    @property
    def checkpoint_layers(self) -> range:
        """The MTP layers' indices in the checkpoint (model.layers.L), and of their KV layers."""
        return range(self.first_layer, self.first_layer + self.config.mtp_layers)

    def forward(
        self,
        hidden: torch.Tensor,
        next_token_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: tuple[torch.Tensor, ...],
        metadata: object,
        backend: AttentionBackend,
        *,
        layer: int = 0,
    ) -> torch.Tensor:
        """MTP layer `layer`'s out ([tokens, hidden], after shared_head.norm) at each of the step's
        tokens. `hidden`: the main model's final hidden state at each position, or a previous draft
        step's out; `next_token_ids`: the token after each position; `positions`: each hidden state's
        own position, at whose slot (metadata.slot_mapping) the layer's latent is written into
        `kv_cache`, that layer's (latent,) as the main model's layers take theirs."""
        mtp = self.layers[layer]
        embeddings = mtp.embed_tokens(next_token_ids)
        combined = mtp.eh_proj(torch.cat([mtp.enorm(embeddings), mtp.hnorm(hidden)], dim=-1))
        norm = mtp.shared_head.norm
        if self.fused_ops:
            out, residual = mtp.block.forward_fused(combined, None, positions, kv_cache, metadata, backend, self.rotary)
            return fused_add_rms_norm(out, residual, norm.weight, norm.eps)
        angles = self.rotary.angles(positions, combined.dtype)
        return norm(mtp.block(combined, positions, angles, kv_cache, metadata, backend, self.rotary))

    def compute_logits(self, hidden: torch.Tensor, *, layer: int = 0) -> torch.Tensor:
        """Float32 logits over the vocabulary of `forward`'s out: each predicts the token two past
        its position."""
        return F.linear(hidden, self.layers[layer].shared_head.head.weight).float()

    def kv_cache_spec(self, *, dtype: torch.dtype, page_size: int, fp8: bool = False) -> KVCacheSpec:
        """The KV the MTP layers keep: one latent per position and layer, numbered after the main
        model's layers. A position's latent goes to the slot the main model's takes, so the group can
        share the main model's block tables."""
        return latent(
            tuple(self.checkpoint_layers), self.config.mla.latent_width, dtype=dtype, page_size=page_size, fp8=fp8
        )

    def share_main_weights(self, main: nn.Module, loaded: Collection[str]) -> None:
        """Each layer's embedding and head: its own where `loaded` (the checkpoint's tensors read)
        holds it, else the main model's, shared (random weights: always)."""
        head = main.embed_tokens.weight if main.lm_head is None else main.lm_head.weight
        for layer, mtp in zip(self.checkpoint_layers, self.layers, strict=True):
            if f"model.layers.{layer}.embed_tokens.weight" not in loaded:
                mtp.embed_tokens.weight = main.embed_tokens.weight
            if f"model.layers.{layer}.shared_head.head.weight" not in loaded:
                mtp.shared_head.head.weight = head


def predictor_name(name: str, num_layers: int) -> str:
    """Our name of a checkpoint name without its "model." prefix: an MTP layer's (layers.L. with L at
    or past num_layers) goes under mtp.layers.k., its decoder layer's parts under mtp.layers.k.block.;
    any other is unchanged."""
    layer = LAYER.match(name)
    if layer is None or int(layer[1]) < num_layers:
        return name
    rest = name[layer.end() :]
    block = "" if rest.startswith(OWN_PARTS) else "block."
    return f"mtp.layers.{int(layer[1]) - num_layers}.{block}{rest}"


def checkpoint_name(name: str, num_layers: int) -> str:
    """predictor_name's inverse: an MTP module's or parameter's name as the checkpoint's, without "model."."""
    layer = PREDICTOR_LAYER.match(name)
    if layer is None:
        return name
    return f"layers.{num_layers + int(layer[1])}.{name[layer.end() :]}"
