"""DeepSeek-V3's multi-token-prediction layer (models.mtp) loaded from a tiny checkpoint with HF's
weight names, held against a torch reference of the report's equations: the MTP layer's own parts
(enorm, hnorm, eh_proj, shared_head) written here in plain torch, its transformer block HF's
DeepseekV3DecoderLayer (MLA and routed experts) fed the main model's final hidden state as HF computes
it. Also: its fused-ops path (in Triton's interpreter off CUDA), loading without it skips its tensors
as before, what is refused and how, and its FP8 form."""

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated, so set it first

from kernels.attention import AttentionMetadata, get_backend  # noqa: E402
from tests.workers.engine.hf_moe_reference import TINY_MOE_CONFIGS, build_hf_moe_model_from  # noqa: E402
from tests.workers.engine.weights.fp8_checkpoints import (  # noqa: E402
    DEEPSEEK_V3,
    FP8_CONFIG,
    dequantized,
    hf_weights,
    quantized,
    write_checkpoint,
)
from workers.engine.kv.kv_cache import KVCache  # noqa: E402
from workers.engine.layers.fp8_linear import Fp8Linear  # noqa: E402
from workers.engine.model_loader import LoadedModel, load_model  # noqa: E402
from workers.protocol.errors import ModelLoadError  # noqa: E402

CPU = torch.device("cpu")
PAGE_SIZE = 16
# Four layers (the first two dense) and one MTP layer, which is layer 4 and routed.
CONFIG = {**TINY_MOE_CONFIGS["deepseek_v3"], "num_nextn_predict_layers": 1}
MTP_LAYER = CONFIG["num_hidden_layers"]
LENGTH = 21


def load(source, **options) -> LoadedModel:
    return load_model(source, device=CPU, dtype=torch.float32, seed=0, max_model_len=64, **options)


def mtp_own_tensors(config: dict, layer: int, *, with_embedding_and_head: bool) -> dict[str, torch.Tensor]:
    """The MTP layer's tensors besides its decoder layer's, random and unlike the main model's."""
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    generator = torch.Generator().manual_seed(7)

    def random(*shape: int, scale: float) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * scale

    tensors = {
        "enorm.weight": 1 + random(hidden, scale=0.1),
        "hnorm.weight": 1 + random(hidden, scale=0.1),
        "eh_proj.weight": random(hidden, 2 * hidden, scale=0.1),
        "shared_head.norm.weight": 1 + random(hidden, scale=0.1),
    }
    if with_embedding_and_head:
        tensors["embed_tokens.weight"] = random(vocab, hidden, scale=1.0)
        tensors["shared_head.head.weight"] = random(vocab, hidden, scale=0.1)
    return {f"model.layers.{layer}.{name}": tensor for name, tensor in tensors.items()}


def saved_tensors(model: nn.Module, directory: Path) -> dict[str, torch.Tensor]:
    model.save_pretrained(directory)
    return {
        name: tensor for path in sorted(directory.glob("*.safetensors")) for name, tensor in load_file(path).items()
    }


@pytest.fixture(scope="module")
def hf_model():
    """HF's DeepSeek-V3 with one layer more than CONFIG serves: HF runs the first four (its config says
    four), the fifth is the MTP layer's transformer block."""
    model = build_hf_moe_model_from({**CONFIG, "num_hidden_layers": MTP_LAYER + 1})
    model.config.num_hidden_layers = MTP_LAYER
    return model


@pytest.fixture(scope="module")
def checkpoint_tensors(hf_model, tmp_path_factory):
    """The checkpoint's tensors: the main model's, the MTP layer's decoder layer (model.layers.4.*)
    and its own parts, its embedding and head included."""
    tensors = saved_tensors(hf_model, tmp_path_factory.mktemp("hf"))
    return {**tensors, **mtp_own_tensors(CONFIG, MTP_LAYER, with_embedding_and_head=True)}


@pytest.fixture(scope="module")
def checkpoint(checkpoint_tensors, tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("mtp"), CONFIG, checkpoint_tensors)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = CONFIG["rms_norm_eps"]) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def reference_logits(hf_model, tensors: dict, tokens: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
    """The MTP layer's logits at every position i of `tokens`, from h_i the main model's final hidden
    state there (after its final norm) as HF computes it, and t_{i+1} `next_tokens[i]`."""
    with torch.no_grad():
        hidden = hf_model.model(tokens[None]).last_hidden_state[0]
    return reference_mtp(hf_model, tensors, hidden, next_tokens)[1]


def reference_mtp(
    hf_model, tensors: dict, hidden: torch.Tensor, next_tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The report's MTP layer at every position i, (out, logits): eh_proj([enorm(Emb(t_{i+1}));
    hnorm(h_i)]) through the transformer block (HF's decoder layer, causal over the positions), then
    shared_head's norm (out) and head (logits); Emb and head the MTP layer's own."""

    def own(name: str) -> torch.Tensor:
        return tensors[f"model.layers.{MTP_LAYER}.{name}"]

    length = hidden.shape[0]
    positions = torch.arange(length)[None]
    with torch.no_grad():
        hidden = hidden[None]
        embeddings = F.embedding(next_tokens[None], own("embed_tokens.weight"))
        combined = torch.cat([rms_norm(embeddings, own("enorm.weight")), rms_norm(hidden, own("hnorm.weight"))], -1)
        block_input = F.linear(combined, own("eh_proj.weight"))
        causal = torch.full((length, length), float("-inf")).triu(1)[None, None]
        block_output = hf_model.model.layers[MTP_LAYER](
            block_input,
            attention_mask=causal,
            position_ids=positions,
            position_embeddings=hf_model.model.rotary_emb(block_input, positions),
        )
        out = rms_norm(block_output, own("shared_head.norm.weight"))[0]
        return out, F.linear(out, own("shared_head.head.weight"))


class Pass:
    """One forward over a sequence's tokens with the torch reference backend: the main model's, then
    the MTP layer's, each over KV of its own built here from the specs."""

    def __init__(self, loaded: LoadedModel, num_pages: int = 4) -> None:
        self.loaded = loaded
        self.backend = get_backend("torch_blockwise")
        config = loaded.config
        self.kv = KVCache.for_model(config, num_pages=num_pages, page_size=PAGE_SIZE, dtype=torch.float32, device=CPU)
        if loaded.model.mtp is not None:
            spec = loaded.model.mtp.kv_cache_spec(dtype=torch.float32, page_size=PAGE_SIZE)
            # The MTP layer's (latent,), as KVCache holds a latent layer's.
            self.mtp_kv = tuple(torch.zeros(spec.pages_shape(num_pages))[0].unbind(0))
        self.block_table = list(range(num_pages))

    def metadata(self, query_len: int, seq_len: int) -> AttentionMetadata:
        return AttentionMetadata.build(
            query_lens=[query_len], seq_lens=[seq_len], block_tables=[self.block_table], page_size=PAGE_SIZE, device=CPU
        )

    def main_hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        metadata = self.metadata(len(tokens), len(tokens))
        layers = self.loaded.config.num_layers
        with torch.no_grad():
            return self.loaded.model(
                tokens, torch.arange(len(tokens)), self.kv.layers, [metadata] * layers, self.backend
            )

    def mtp_logits(self, hidden: torch.Tensor, next_tokens: torch.Tensor, first: int, seq_len: int) -> torch.Tensor:
        """MTP logits of positions first.. first + len(hidden), the cache holding those before."""
        positions = torch.arange(first, first + len(hidden))
        mtp = self.loaded.model.mtp
        with torch.no_grad():
            out = mtp(hidden, next_tokens, positions, self.mtp_kv, self.metadata(len(hidden), seq_len), self.backend)
            return mtp.compute_logits(out)


def sequence(length: int = LENGTH + 1) -> torch.Tensor:
    return torch.randint(0, CONFIG["vocab_size"], (length,), generator=torch.Generator().manual_seed(3))


def test_the_mtp_layer_is_the_reports_equations_over_a_prefill_and_a_decode_step(
    checkpoint, checkpoint_tensors, hf_model
):
    tokens = sequence()
    inputs, next_tokens = tokens[:-1], tokens[1:]
    expected = reference_logits(hf_model, checkpoint_tensors, inputs, next_tokens)
    run = Pass(load(checkpoint, with_mtp=True))
    hidden = run.main_hidden(inputs)

    # A prefill of all but the last position, then the last one as a decode step reading the cache.
    prefill = run.mtp_logits(hidden[:-1], next_tokens[:-1], first=0, seq_len=LENGTH - 1)
    decode = run.mtp_logits(hidden[-1:], next_tokens[-1:], first=LENGTH - 1, seq_len=LENGTH)

    torch.testing.assert_close(torch.cat([prefill, decode]), expected, atol=1e-5, rtol=1e-5)
    assert expected.std() > 0.1  # the logits are far from zero: the comparison means something


def test_k_chained_greedy_draft_steps_are_the_reference_over_the_chained_inputs(
    checkpoint, checkpoint_tensors, hf_model
):
    # The main model has computed `prompt` and sampled `sampled`. Draft step 1 runs the MTP layer
    # over every position (h_i, t_{i+1}), the last pairing h_{n-1} with the sampled token; each later
    # step one position on, from the previous step's out and draft: one decode row reading the MTP
    # layer's KV of the positions before.
    steps = 4
    tokens = sequence()
    prompt, sampled = tokens[:-1], tokens[-1:]
    run = Pass(load(checkpoint, with_mtp=True))
    mtp = run.loaded.model.mtp
    hidden = run.main_hidden(prompt)
    inputs, next_tokens = hidden, torch.cat([prompt[1:], sampled])
    first, drafts, draft_logits = 0, [], []
    with torch.no_grad():
        for _ in range(steps):
            positions = torch.arange(first, first + len(inputs))
            metadata = run.metadata(len(inputs), first + len(inputs))
            out = mtp(inputs, next_tokens, positions, run.mtp_kv, metadata, run.backend)
            logits = mtp.compute_logits(out[-1:])
            draft_logits.append(logits[0])
            drafts.append(int(logits.argmax()))
            first += len(inputs)
            inputs, next_tokens = out[-1:], torch.tensor(drafts[-1:])

    # The reference runs the whole chained sequence at once, growing it a draft at a time.
    with torch.no_grad():
        chained_hidden = hf_model.model(prompt[None]).last_hidden_state[0]
    chained_tokens = torch.cat([prompt[1:], sampled])
    expected = []
    for _ in range(steps):
        out, logits = reference_mtp(hf_model, checkpoint_tensors, chained_hidden, chained_tokens)
        expected.append(logits[-1])
        chained_hidden = torch.cat([chained_hidden, out[-1:]])
        chained_tokens = torch.cat([chained_tokens, logits[-1:].argmax(-1)])

    assert drafts == chained_tokens[-steps:].tolist()
    torch.testing.assert_close(torch.stack(draft_logits), torch.stack(expected), atol=1e-5, rtol=1e-5)


def test_the_fused_ops_path_gives_the_reference_paths_out(checkpoint):
    loaded = load(checkpoint, with_mtp=True)
    tokens = sequence()
    reference = Pass(loaded)
    hidden = reference.main_hidden(tokens[:-1])
    expected = reference.mtp_logits(hidden, tokens[1:], first=0, seq_len=LENGTH)
    fused = Pass(loaded)

    loaded.model.use_fused_ops(True)
    logits = fused.mtp_logits(hidden, tokens[1:], first=0, seq_len=LENGTH)

    assert loaded.model.mtp.fused_ops
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused.mtp_kv[0], reference.mtp_kv[0], atol=1e-5, rtol=1e-5)


def test_the_mtp_layer_keeps_its_own_embedding_and_head_and_has_a_latent_kv_layer_after_the_models(checkpoint):
    loaded = load(checkpoint, with_mtp=True)
    mtp = loaded.model.mtp
    spec = mtp.kv_cache_spec(dtype=torch.float32, page_size=PAGE_SIZE)

    assert mtp.layers[0].embed_tokens.weight is not loaded.model.embed_tokens.weight
    assert mtp.layers[0].shared_head.head.weight is not loaded.model.lm_head.weight
    assert spec.layers == (MTP_LAYER,)
    assert spec.latent_width == CONFIG["kv_lora_rank"] + CONFIG["qk_rope_head_dim"]


def test_without_its_own_embedding_and_head_the_mtp_layer_shares_the_main_models(
    checkpoint_tensors, hf_model, tmp_path
):
    own = mtp_own_tensors(CONFIG, MTP_LAYER, with_embedding_and_head=True)
    shared = {name: tensor for name, tensor in checkpoint_tensors.items() if name not in own}
    shared.update(mtp_own_tensors(CONFIG, MTP_LAYER, with_embedding_and_head=False))
    loaded = load(write_checkpoint(tmp_path, CONFIG, shared), with_mtp=True)
    mtp = loaded.model.mtp
    tokens = sequence()
    reference_tensors = {
        **checkpoint_tensors,
        f"model.layers.{MTP_LAYER}.embed_tokens.weight": checkpoint_tensors["model.embed_tokens.weight"],
        f"model.layers.{MTP_LAYER}.shared_head.head.weight": checkpoint_tensors["lm_head.weight"],
    }
    expected = reference_logits(hf_model, reference_tensors, tokens[:-1], tokens[1:])
    run = Pass(loaded)

    logits = run.mtp_logits(run.main_hidden(tokens[:-1]), tokens[1:], first=0, seq_len=LENGTH)

    assert mtp.layers[0].embed_tokens.weight is loaded.model.embed_tokens.weight
    assert mtp.layers[0].shared_head.head.weight is loaded.model.lm_head.weight
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)


def test_random_weights_build_an_mtp_layer_sharing_the_main_models_embedding_and_head():
    loaded = load(CONFIG, with_mtp=True)
    mtp = loaded.model.mtp

    assert mtp.layers[0].embed_tokens.weight is loaded.model.embed_tokens.weight
    assert mtp.layers[0].shared_head.head.weight is loaded.model.lm_head.weight
    assert mtp.layers[0].eh_proj.weight.std() > 0


def test_without_mtp_asked_its_tensors_are_skipped_and_the_main_model_is_the_same(checkpoint):
    plain, with_mtp = load(checkpoint), load(checkpoint, with_mtp=True)
    tokens = sequence()[:-1]

    assert plain.model.mtp is None
    assert set(plain.model.state_dict()) == {
        name for name in with_mtp.model.state_dict() if not name.startswith("mtp.")
    }
    torch.testing.assert_close(Pass(plain).main_hidden(tokens), Pass(with_mtp).main_hidden(tokens), rtol=0, atol=0)


def test_mtp_asked_of_a_checkpoint_without_its_tensors_is_refused_naming_num_nextn_predict_layers(hf_model, tmp_path):
    main_only = saved_tensors(build_hf_moe_model_from(TINY_MOE_CONFIGS["deepseek_v3"]), tmp_path / "hf")
    directory = write_checkpoint(tmp_path / "checkpoint", CONFIG, main_only)

    assert load(directory).model.mtp is None
    with pytest.raises(ModelLoadError, match=r"num_nextn_predict_layers=1 .* e\.g\. \['model\.layers\.4\."):
        load(directory, with_mtp=True)


def test_an_mtp_layer_missing_a_tensor_is_refused_naming_it(checkpoint_tensors, tmp_path):
    tensors = {name: t for name, t in checkpoint_tensors.items() if name != f"model.layers.{MTP_LAYER}.eh_proj.weight"}
    directory = write_checkpoint(tmp_path, CONFIG, tensors)

    with pytest.raises(ModelLoadError, match=r"num_nextn_predict_layers=1 .*'model\.layers\.4\.eh_proj\.weight'"):
        load(directory, with_mtp=True)


@pytest.mark.parametrize("config", [TINY_MOE_CONFIGS["deepseek_v3"], TINY_MOE_CONFIGS["deepseek_v2"]])
def test_mtp_asked_of_a_model_without_mtp_layers_is_refused_naming_num_nextn_predict_layers(config):
    with pytest.raises(ModelLoadError, match="num_nextn_predict_layers"):
        load(config, with_mtp=True)


@pytest.fixture(scope="module")
def fp8_checkpoints(tmp_path_factory):
    """(FP8 checkpoint, its dequantized float32 copy) of a tiny DeepSeek-V3 with an MTP layer (layer 3),
    quantized as DeepSeek-V3's: the MTP layer's decoder layer in e4m3, its eh_proj, embedding and
    head not."""
    config = {**DEEPSEEK_V3, "num_nextn_predict_layers": 1}
    layers = DEEPSEEK_V3["num_hidden_layers"]
    weights = hf_weights({**DEEPSEEK_V3, "num_hidden_layers": layers + 1})
    weights.update(mtp_own_tensors(config, layers, with_embedding_and_head=True))
    tensors = quantized(weights)
    root = tmp_path_factory.mktemp("fp8")
    return (
        write_checkpoint(root / "fp8", config, tensors, FP8_CONFIG),
        write_checkpoint(root / "dequantized", config, dequantized(tensors)),
    )


def test_an_fp8_checkpoints_mtp_layer_loads_its_e4m3_weights_into_fp8_modules(fp8_checkpoints):
    fp8, dequantized_copy = fp8_checkpoints
    ours, reference = load(fp8, with_mtp=True), load(dequantized_copy, with_mtp=True)
    mtp = ours.model.mtp.layers[0]
    reference_params = reference.model.state_dict()

    assert isinstance(mtp.block.self_attn.q_a_proj, Fp8Linear)
    assert isinstance(mtp.block.mlp.shared_expert.down_proj, Fp8Linear)
    assert mtp.block.mlp.experts.block is not None
    # Saved in bf16 by DeepSeek-V3, kept so; the head is an output head like lm_head.
    assert type(mtp.eh_proj) is nn.Linear and type(mtp.shared_head.head) is nn.Linear
    for name, param in ours.model.state_dict().items():
        assert torch.equal(param, reference_params[name]), name


def test_quantization_fp8_quantizes_the_mtp_layers_projections_but_not_its_head(fp8_checkpoints):
    _, dequantized_copy = fp8_checkpoints
    mtp = load(dequantized_copy, with_mtp=True, quantization="fp8").model.mtp.layers[0]

    assert isinstance(mtp.eh_proj, Fp8Linear) and isinstance(mtp.block.self_attn.o_proj, Fp8Linear)
    assert type(mtp.shared_head.head) is nn.Linear
