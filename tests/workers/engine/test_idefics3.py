"""Idefics3 / SmolVLM against Hugging Face transformers on tiny random weights: the vision encoder's
embeddings, the prefill logits of an image+text prompt through the paged decoder with the image
embeddings injected (also across chunks that cut an image), greedy tokens, and config refusals."""

import pytest
import torch

from kernels.attention import TORCH_BACKENDS, AttentionMetadata, get_backend
from tests.workers.engine.hf_idefics3_reference import IMAGE_TOKEN_ID, TINY_IDEFICS3, build_hf_idefics3
from workers.engine import LLM, ModelLoadError, SamplingParams
from workers.engine.kv.kv_cache import KVCache
from workers.engine.model_loader import load_model
from workers.engine.models.decoder import InjectedEmbeddings
from workers.engine.models.idefics3 import (
    Idefics3,
    Idefics3ForConditionalGeneration,
    Idefics3VisionEncoder,
    inject_image_embeddings,
)
from workers.engine.models.registry import family_of, model_config
from workers.engine.models.vision.connector import pixel_shuffle
from workers.engine.models.vision.siglip import patch_position_ids

PAGE_SIZE = 16
FAKE_AROUND_IMAGE, GLOBAL_IMAGE = 118, 119
HF_CONFIG = {**TINY_IDEFICS3, "architectures": ["Idefics3ForConditionalGeneration"]}


@pytest.fixture(scope="module")
def hf_model():
    return build_hf_idefics3()


@pytest.fixture(scope="module")
def model(hf_model):
    config = model_config(HF_CONFIG)
    ours = Idefics3ForConditionalGeneration(config, max_positions=256).eval()
    ours.load_weights(hf_model.state_dict().items())
    return ours


def tiles(count: int, seed: int = 3) -> torch.Tensor:
    return torch.randn(count, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def image_prompt(num_tiles: int, image_seq_len: int) -> list[int]:
    """Text, an image's placeholders laid out as the processor lays them (per tile a marker and its
    placeholders), text."""
    ids = [5, 17, 42]
    for tile in range(num_tiles):
        ids += [FAKE_AROUND_IMAGE, GLOBAL_IMAGE if tile == num_tiles - 1 else 100 + tile]
        ids += [IMAGE_TOKEN_ID] * image_seq_len
    return ids + [FAKE_AROUND_IMAGE, 7, 9, 11]


def hf_image_embeddings(hf_model, pixel_values: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        features = hf_model.model.get_image_features(pixel_values[None]).pooler_output
    return torch.cat(features)


def paged_metadata(query_len: int, seq_len: int) -> AttentionMetadata:
    return AttentionMetadata.build(
        query_lens=[query_len],
        seq_lens=[seq_len],
        block_tables=[[4, 1, 3, 0]],  # pages out of order on purpose
        page_size=PAGE_SIZE,
        device=torch.device("cpu"),
    )


def test_the_config_reads_the_vision_side():
    config = model_config(HF_CONFIG)

    assert config.family == "idefics3"
    assert config.hidden_size == 64 and config.num_layers == 2
    assert config.vision.hidden_size == 32 and config.vision.patches_per_side == 4
    assert config.image_seq_len == 4 and config.image_token_id == IMAGE_TOKEN_ID
    assert isinstance(family_of({"architectures": ["SmolVLMForConditionalGeneration"]}), Idefics3)


def test_pixel_shuffle_matches_hf_connector(hf_model):
    features = torch.randn(3, 16, 32, generator=torch.Generator().manual_seed(0))

    ours = pixel_shuffle(features, 2)

    assert torch.equal(ours, hf_model.model.connector.pixel_shuffle(features, 2))


def test_vision_embeddings_match_hf(hf_model):
    """The encode worker's module alone: built from the config, loaded with the vision tensors only."""
    encoder = Idefics3VisionEncoder(model_config(HF_CONFIG)).eval()
    encoder.load_weights(
        (n, t) for n, t in hf_model.state_dict().items() if not n.startswith(("lm_head", "model.text"))
    )
    pixel_values = tiles(5)

    with torch.no_grad():
        ours = encoder(pixel_values)

    assert ours.shape == (5 * 4, 64)
    torch.testing.assert_close(ours, hf_image_embeddings(hf_model, pixel_values), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", TORCH_BACKENDS)
def test_prefill_logits_of_an_image_prompt_match_hf(hf_model, model, backend):
    pixel_values = tiles(3)
    prompt = torch.tensor(image_prompt(3, model.config.image_seq_len))
    kv = KVCache.for_model(
        model.config, num_pages=5, page_size=PAGE_SIZE, dtype=torch.float32, device=torch.device("cpu")
    )

    with torch.no_grad():
        expected = hf_model(input_ids=prompt[None], pixel_values=pixel_values[None]).logits[0]
        injected = inject_image_embeddings(prompt, IMAGE_TOKEN_ID, model.encode_images(pixel_values))
        hidden = model(
            prompt,
            torch.arange(len(prompt)),
            kv.layers,
            [paged_metadata(len(prompt), len(prompt))] * model.config.num_layers,
            get_backend(backend),
            injected=injected,
        )
        ours = model.compute_logits(hidden)

    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


def prefill_in_chunks(
    model, prompt: torch.Tensor, embeddings: torch.Tensor, kv: KVCache, cuts: list[int]
) -> torch.Tensor:
    """The prompt prefilled chunk by chunk, each chunk given the embeddings of the placeholders it
    holds (the ones before it already consumed), as a prefill receiving them from an encoder would.
    Returns the last token's logits."""
    backend = get_backend(TORCH_BACKENDS[0])
    used = 0
    bounds = [0, *cuts, len(prompt)]
    for start, end in zip(bounds, bounds[1:]):
        chunk = prompt[start:end]
        rows = torch.nonzero(chunk == IMAGE_TOKEN_ID).flatten()
        injected = InjectedEmbeddings(rows=rows, embeddings=embeddings[used : used + rows.numel()])
        used += rows.numel()
        metadata = [paged_metadata(end - start, end)] * model.config.num_layers
        hidden = model(chunk, torch.arange(start, end), kv.layers, metadata, backend, injected=injected)
    return model.compute_logits(hidden[-1:])


def test_greedy_tokens_of_an_image_prompt_match_hf_generate(hf_model, model):
    """Prefill in chunks whose bounds cut through an image's placeholders, then paged decode steps."""
    pixel_values = tiles(3, seed=7)
    prompt = torch.tensor(image_prompt(3, model.config.image_seq_len))
    kv = KVCache.for_model(
        model.config, num_pages=5, page_size=PAGE_SIZE, dtype=torch.float32, device=torch.device("cpu")
    )
    steps = 12

    with torch.no_grad():
        expected = hf_model.generate(
            input_ids=prompt[None],
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            pixel_values=pixel_values[None],
            max_new_tokens=steps,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        logits = prefill_in_chunks(model, prompt, model.encode_images(pixel_values), kv, cuts=[7, 13, 20])
        ours = [int(logits.argmax(-1))]
        backend = get_backend(TORCH_BACKENDS[0])
        for position in range(len(prompt), len(prompt) + steps - 1):
            metadata = [paged_metadata(1, position + 1)] * model.config.num_layers
            hidden = model(torch.tensor(ours[-1:]), torch.tensor([position]), kv.layers, metadata, backend)
            ours.append(int(model.compute_logits(hidden).argmax(-1)))

    assert ours == expected


def test_text_only_generation_from_a_saved_checkpoint_matches_hf(hf_model, tmp_path):
    """The family loads from an HF directory through the engine, and its text path is the decoder's."""
    hf_model.save_pretrained(tmp_path)
    llm = LLM(tmp_path, seed=0, kv_cache_bytes=1 << 24, max_num_batched_tokens=16)
    prompt = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43]

    ours = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0].token_ids

    with torch.no_grad():
        expected = hf_model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
    assert ours == expected


def test_the_image_embeddings_must_match_the_placeholders(model):
    prompt = torch.tensor(image_prompt(2, model.config.image_seq_len))

    with pytest.raises(ValueError, match="8 image placeholders .* 4 image embeddings"):
        inject_image_embeddings(prompt, IMAGE_TOKEN_ID, torch.zeros(4, 64))


def test_unknown_and_missing_tensors_are_refused(hf_model):
    model = Idefics3ForConditionalGeneration(model_config(HF_CONFIG), max_positions=64)
    weights = dict(hf_model.state_dict())

    with pytest.raises(ModelLoadError, match="model.vision_model.head.weight"):
        model.load_weights([*weights.items(), ("model.vision_model.head.weight", torch.zeros(1))])
    with pytest.raises(ModelLoadError, match="model.perceiver.weight"):
        model.load_weights([*weights.items(), ("model.perceiver.weight", torch.zeros(1))])
    del weights["model.connector.modality_projection.proj.weight"]
    with pytest.raises(ModelLoadError, match="lacks 1 vision tensors"):
        model.load_weights(weights.items())


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"vision_config": {**TINY_IDEFICS3["vision_config"], "hidden_act": "quick_gelu"}}, "vision_config.hidden_act"),
        ({"vision_config": {**TINY_IDEFICS3["vision_config"], "patch_size": 40}}, "vision_config.patch_size"),
        ({"vision_config": {**TINY_IDEFICS3["vision_config"], "image_size": [32, 16]}}, "vision_config.image_size"),
        (
            {"vision_config": {**TINY_IDEFICS3["vision_config"], "num_attention_heads": 5}},
            "vision_config.num_attention_heads",
        ),
        ({"scale_factor": 3}, "scale_factor"),
        ({"scale_factor": 0}, "scale_factor"),
        ({"image_token_id": 500}, "image_token_id"),
        ({"text_config": {**TINY_IDEFICS3["text_config"], "model_type": "mistral"}}, "text_config.model_type"),
    ],
)
def test_bad_config_fields_are_refused_by_name(change, field):
    with pytest.raises(ModelLoadError, match=field.replace(".", r"\.")):
        model_config({**HF_CONFIG, **change})


def test_a_patch_size_that_does_not_divide_the_tile_drops_its_last_pixels_as_hf():
    """SmolVLM-Instruct's tower: 384-pixel tiles of 14-pixel patches, 27 per side, the last 6 pixels
    of each row and column read by no patch; here 27-pixel tiles of 2-pixel patches, 13 per side."""
    from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig
    from transformers.models.idefics3.modeling_idefics3 import Idefics3VisionEmbeddings

    vision = {**TINY_IDEFICS3["vision_config"], "image_size": 27, "patch_size": 2}
    torch.manual_seed(0)
    reference = Idefics3VisionEmbeddings(Idefics3VisionConfig(**vision))
    ours = Idefics3VisionEncoder(model_config({**HF_CONFIG, "vision_config": vision, "scale_factor": 1}))
    ours.vision_model.embeddings.load_state_dict(reference.state_dict())
    pixel_values = torch.randn(2, 3, 27, 27)
    full = torch.ones(2, 13, 13, dtype=torch.bool)

    with torch.no_grad():
        embedded = ours.vision_model.embeddings(pixel_values)
    assert embedded.shape == (2, 13 * 13, vision["hidden_size"])
    torch.testing.assert_close(embedded, reference(pixel_values, full))


@pytest.mark.parametrize("patches_per_side", [4, 19, 26])
def test_patch_embeddings_match_hf_where_its_position_buckets_round(patches_per_side):
    """HF buckets patch coordinates in float32; at 19 patches per side some land on a neighbour's row."""
    from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig
    from transformers.models.idefics3.modeling_idefics3 import Idefics3VisionEmbeddings

    vision = {**TINY_IDEFICS3["vision_config"], "image_size": 2 * patches_per_side, "patch_size": 2}
    torch.manual_seed(0)
    reference = Idefics3VisionEmbeddings(Idefics3VisionConfig(**vision))
    ours = Idefics3VisionEncoder(model_config({**HF_CONFIG, "vision_config": vision, "scale_factor": 1}))
    ours.vision_model.embeddings.load_state_dict(reference.state_dict())
    pixel_values = torch.randn(2, 3, 2 * patches_per_side, 2 * patches_per_side)
    full = torch.ones(2, patches_per_side, patches_per_side, dtype=torch.bool)

    with torch.no_grad():
        torch.testing.assert_close(ours.vision_model.embeddings(pixel_values), reference(pixel_values, full))


def test_patch_positions_do_not_depend_on_the_default_dtype():
    """The engine builds a model under its serving dtype as the default; the buckets stay float32's."""
    expected = patch_position_ids(19)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        built_in_bf16 = patch_position_ids(19)
    finally:
        torch.set_default_dtype(previous)

    assert torch.equal(built_in_bf16, expected)


def test_random_weights_from_a_bare_config_load_in_bfloat16():
    """The loader's path without a checkpoint: built under bfloat16, drawn from the seed, vision included."""
    loaded = load_model(HF_CONFIG, device=torch.device("cpu"), dtype=torch.bfloat16, seed=0, max_model_len=None)
    vision = loaded.model.vision

    with torch.no_grad():
        embeddings = loaded.model.encode_images(tiles(2))

    assert embeddings.shape == (8, 64) and embeddings.dtype == torch.bfloat16
    assert torch.isfinite(embeddings).all()
    assert torch.equal(vision.vision_model.post_layernorm.weight, torch.ones(32, dtype=torch.bfloat16))
    assert torch.equal(vision.vision_model.encoder.layers[0].layer_norm1.weight, torch.ones(32, dtype=torch.bfloat16))
