"""DeepSeek-V2 and -V3: multi-head latent attention (MLA), routed experts with shared ones, the
first layers dense. Their configs read as transformers reads them, its defaults for missing keys.

V2 routes by softmax (plain or group-limited top-k, times routed_scaling_factor, never renormalised);
V3 by sigmoid within the best groups, chosen with a correction bias ("noaux_tc"). V3 checkpoints
also hold the multi-token-prediction layers past num_hidden_layers (num_nextn_predict_layers): the
loader skips them unless asked for them (models.mtp)."""

from typing import Any, ClassVar

from workers.engine.config import MlaConfig, ModelConfig, MoeConfig
from workers.engine.layers.rotary import yarn_mscale
from workers.engine.models.family import DecoderFamily, rope_parameters, routed_expert_settings
from workers.protocol.errors import ModelLoadError

# Fields both versions' HF configs default alike.
_SHARED_DEFAULTS: dict[str, Any] = {
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
}


class _DeepSeek(DecoderFamily):
    # transformers' config defaults for the keys a config.json may leave out.
    hf_defaults: ClassVar[dict[str, Any]]
    topk_methods: ClassVar[tuple[str, ...]]
    scoring_func: ClassVar[str]

    def model_config(self, hf: dict[str, Any]) -> ModelConfig:
        hf = {**self.hf_defaults, **hf}
        self.refuse_unserved(hf)
        return super().model_config(hf)

    def refuse_unserved(self, hf: dict[str, Any]) -> None:
        """Refuse, naming the field, what a config may ask that is not served as it says."""
        if hf.get("scoring_func", self.scoring_func) != self.scoring_func:
            raise ModelLoadError(f"unsupported scoring_func {hf['scoring_func']!r}; supported: {self.scoring_func}")
        topk_method = hf.get("topk_method", self.topk_methods[0])
        if topk_method not in self.topk_methods:
            raise ModelLoadError(f"unsupported topk_method {topk_method!r}; supported: {', '.join(self.topk_methods)}")
        # DeepSeek's own code routes only every moe_layer_freq-th layer; HF routes every layer past the
        # dense ones, whatever it says. The two agree only at 1.
        if hf.get("moe_layer_freq", 1) not in (1, None):
            raise ModelLoadError(f"moe_layer_freq other than 1 is not supported, got {hf['moe_layer_freq']}")

    def num_kv_heads(self, hf: dict[str, Any], num_heads: int) -> int:
        # MLA expands one latent into every head's keys and values: num_key_value_heads means nothing.
        return num_heads

    def head_dim(self, hf: dict[str, Any], hidden_size: int, num_heads: int) -> int:
        # A config's own head_dim is HF's rotary width (qk_rope_head_dim), not the head's.
        return int(hf["qk_nope_head_dim"]) + int(hf["qk_rope_head_dim"])

    def mla_config(self, hf: dict[str, Any]) -> MlaConfig:
        q_lora_rank = hf["q_lora_rank"]
        return MlaConfig(
            q_lora_rank=None if q_lora_rank is None else int(q_lora_rank),
            kv_lora_rank=int(hf["kv_lora_rank"]),
            qk_nope_head_dim=int(hf["qk_nope_head_dim"]),
            qk_rope_head_dim=int(hf["qk_rope_head_dim"]),
            v_head_dim=int(hf["v_head_dim"]),
            softmax_scale=_softmax_scale(hf),
            rope_interleave=self.rope_interleave(hf),
        )

    def rope_interleave(self, hf: dict[str, Any]) -> bool:
        raise NotImplementedError

    def attention_bias(self, hf: dict[str, Any]) -> bool:
        if hf["attention_bias"]:
            raise ModelLoadError("attention_bias is not supported for DeepSeek's latent attention")
        return False

    def layer_windows(self, hf: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
        if hf.get("sliding_window") or any(t != "full_attention" for t in hf.get("layer_types") or ()):
            raise ModelLoadError("DeepSeek attends to the whole context: sliding_window/layer_types are not supported")
        return (None,) * num_layers

    def moe_config(self, hf: dict[str, Any], num_layers: int) -> MoeConfig:
        if hf["num_experts_per_tok"] is None:
            raise ModelLoadError("model config lacks num_experts_per_tok")
        top_k, intermediate, norm_topk_prob = routed_expert_settings(hf)
        # As HF: the layers before first_k_dense_replace are dense, all of them if it exceeds their number.
        first_sparse = int(hf["first_k_dense_replace"])
        return MoeConfig(
            num_experts=int(hf["n_routed_experts"]),
            top_k=top_k,
            intermediate_size=intermediate,
            norm_topk_prob=norm_topk_prob,
            sparse_layers=tuple(i >= first_sparse for i in range(num_layers)),
            # The multi-token-prediction layers, numbered after the served ones, route by the same rule.
            mtp_sparse_layers=tuple(i >= first_sparse for i in range(num_layers, num_layers + self.mtp_layers(hf))),
            routed_scaling_factor=float(hf["routed_scaling_factor"]),
            shared_intermediate_size=intermediate * int(hf["n_shared_experts"]),
            **self.routing(hf),
        )

    def routing(self, hf: dict[str, Any]) -> dict[str, Any]:
        """MoeConfig's routing, num_groups and topk_groups."""
        raise NotImplementedError


class DeepseekV2(_DeepSeek):
    name = "deepseek_v2"
    hf_defaults = {
        **_SHARED_DEFAULTS,
        "vocab_size": 102400,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "max_position_embeddings": 2048,
        "mlp_bias": False,
        "first_k_dense_replace": 0,
        "n_group": None,
        "topk_group": None,
        "n_routed_experts": 64,
        "n_shared_experts": 2,
        "num_experts_per_tok": None,
        "moe_intermediate_size": 1407,
        "routed_scaling_factor": 1.0,
        "topk_method": "greedy",
        "norm_topk_prob": False,
    }
    topk_methods = ("greedy", "group_limited_greedy")
    scoring_func = "softmax"

    def refuse_unserved(self, hf: dict[str, Any]) -> None:
        super().refuse_unserved(hf)
        # V3's MLPs have no biases whatever its config says; V2's read mlp_bias.
        if hf["mlp_bias"]:
            raise ModelLoadError("mlp_bias is not supported")

    def rope_interleave(self, hf: dict[str, Any]) -> bool:
        # HF's V2 rotates adjacent pairs as complex numbers, whatever the config says.
        return True

    def routing(self, hf: dict[str, Any]) -> dict[str, Any]:
        if hf["topk_method"] == "greedy":
            return {"routing": "grouped_softmax", "num_groups": 1, "topk_groups": 1}
        for name in ("n_group", "topk_group"):
            if hf[name] is None:
                raise ModelLoadError(f"topk_method group_limited_greedy needs {name}")
        return {"routing": "grouped_softmax", "num_groups": int(hf["n_group"]), "topk_groups": int(hf["topk_group"])}


class DeepseekV3(_DeepSeek):
    name = "deepseek_v3"
    hf_defaults = {
        **_SHARED_DEFAULTS,
        "vocab_size": 129280,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "max_position_embeddings": 4096,
        "first_k_dense_replace": 3,
        "n_group": 8,
        "topk_group": 4,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 2048,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "rope_interleave": True,
    }
    # HF's V3 gate always routes this way and reads neither field; a config naming another is refused.
    topk_methods = ("noaux_tc",)
    scoring_func = "sigmoid"

    def rope_interleave(self, hf: dict[str, Any]) -> bool:
        return bool(hf["rope_interleave"])

    def mtp_layers(self, hf: dict[str, Any]) -> int:
        return int(hf.get("num_nextn_predict_layers") or 0)

    def routing(self, hf: dict[str, Any]) -> dict[str, Any]:
        return {"routing": "grouped_sigmoid", "num_groups": int(hf["n_group"]), "topk_groups": int(hf["topk_group"])}


def _softmax_scale(hf: dict[str, Any]) -> float:
    """qk_head_dim ** -0.5, times the square of YaRN's mscale for mscale_all_dim where the rope is
    scaled and asks for it, in HF's order of operations."""
    scale = (int(hf["qk_nope_head_dim"]) + int(hf["qk_rope_head_dim"])) ** (-0.5)
    params = rope_parameters(hf)
    mscale_all_dim = params.get("mscale_all_dim")
    if params["rope_type"] != "default" and mscale_all_dim:
        mscale = yarn_mscale(float(params["factor"]), float(mscale_all_dim))
        scale = scale * mscale * mscale
    return scale
