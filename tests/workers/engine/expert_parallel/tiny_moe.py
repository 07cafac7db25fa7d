"""The tiny random-weight Qwen3-MoE the EP tests serve: 8 experts, top-2, two MoE layers (layer 1 dense)."""

QWEN3_MOE = dict(
    model_type="qwen3_moe",
    architectures=["Qwen3MoeForCausalLM"],
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    norm_topk_prob=True,
    mlp_only_layers=[1],
)
