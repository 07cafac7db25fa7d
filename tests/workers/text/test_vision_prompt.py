"""How a served vision-language model's directory says images go into its prompts, read without
loading it (workers.text.vision_prompt), against the engine's own reading of the same config."""

import json

import pytest

from workers.protocol.errors import ModelLoadError
from workers.text.idefics3_images import image_tag_tokens
from workers.text.vision_prompt import read_vision_prompt

# SmolVLM-256M's shape: 512-pixel tiles of 16-pixel patches, pixel shuffle by 4, images up to 2048.
SMOLVLM_CONFIG = {
    "architectures": ["SmolVLMForConditionalGeneration"],
    "image_token_id": 49190,
    "scale_factor": 4,
    "vision_config": {"image_size": 512, "patch_size": 16},
}
SMOLVLM_PREPROCESSOR = {"size": {"longest_edge": 2048}, "max_image_size": {"longest_edge": 512}}


def model_dir(tmp_path, preprocessor=SMOLVLM_PREPROCESSOR):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    return tmp_path


def test_a_smolvlm_directory_gives_its_image_token_tokens_and_patches_per_tile(tmp_path):
    vision = read_vision_prompt(model_dir(tmp_path), SMOLVLM_CONFIG)

    assert vision.image_token_id == 49190
    assert vision.settings.image_seq_len == 64  # (512 / 16 / 4)², SmolVLM's image_seq_len
    assert vision.patches_per_tile == 32 * 32
    layout = vision.layout(height=1000, width=1500)  # resized to 2048 x 1366: a 3 × 4 grid
    assert (layout.rows, layout.cols) == (3, 4)
    assert vision.num_tokens(layout) == (12 + 1) * 64 and vision.num_patches(layout) == 13 * 1024


def test_smolvlm_instructs_tiles_count_the_patches_its_tower_reads(tmp_path):
    """384-pixel tiles of 14-pixel patches: 27 per side, the last 6 pixels read by no patch (as HF)."""
    config = {**SMOLVLM_CONFIG, "scale_factor": 3, "vision_config": {"image_size": 384, "patch_size": 14}}
    preprocessor = {"size": {"longest_edge": 1536}, "max_image_size": {"longest_edge": 384}}
    vision = read_vision_prompt(model_dir(tmp_path, preprocessor), config)

    assert vision.patches_per_tile == 27 * 27
    assert vision.settings.image_seq_len == 81  # (27 / 3)², SmolVLM-Instruct's image_seq_len


def test_a_text_model_takes_no_images(tmp_path):
    assert read_vision_prompt(tmp_path, {"architectures": ["LlamaForCausalLM"]}) is None
    assert read_vision_prompt(tmp_path, {}) is None


@pytest.mark.parametrize(
    ("config", "preprocessor", "says"),
    [
        ({**SMOLVLM_CONFIG, "scale_factor": 3}, SMOLVLM_PREPROCESSOR, "scale_factor"),
        ({**SMOLVLM_CONFIG, "image_token_id": "49190"}, SMOLVLM_PREPROCESSOR, "image_token_id"),
        (SMOLVLM_CONFIG, {**SMOLVLM_PREPROCESSOR, "max_image_size": {"longest_edge": 384}}, "image_size"),
        (SMOLVLM_CONFIG, {**SMOLVLM_PREPROCESSOR, "do_rescale": False}, "do_rescale"),
        (SMOLVLM_CONFIG, None, "preprocessor"),
    ],
    ids=["scale-not-dividing", "token-not-an-int", "tile-not-the-towers", "step-turned-off", "no-preprocessor"],
)
def test_a_directory_that_does_not_say_how_to_take_images_is_refused(tmp_path, config, preprocessor, says):
    directory = model_dir(tmp_path, preprocessor) if preprocessor is not None else tmp_path
    with pytest.raises(ModelLoadError, match=says):
        read_vision_prompt(directory, config)


def test_the_tags_are_those_of_the_largest_grid(tmp_path):
    vision = read_vision_prompt(model_dir(tmp_path), SMOLVLM_CONFIG)
    tags = image_tag_tokens(vision.settings)
    assert tags[:3] == ("<fake_token_around_image>", "<image>", "<global-img>")
    assert tags[3:] == tuple(f"<row_{r}_col_{c}>" for r in range(1, 5) for c in range(1, 5))


def test_the_defaults_and_the_image_seq_len_are_the_engines(tmp_path):
    from workers.engine.models import idefics3
    from workers.text import vision_prompt

    assert vision_prompt.DEFAULT_IMAGE_TOKEN_ID == idefics3.DEFAULT_IMAGE_TOKEN_ID
    assert vision_prompt.DEFAULT_SCALE_FACTOR == idefics3.DEFAULT_SCALE_FACTOR
    assert vision_prompt.DEFAULT_IMAGE_SIZE == idefics3.VISION_DEFAULTS["image_size"]
    assert vision_prompt.DEFAULT_PATCH_SIZE == idefics3.VISION_DEFAULTS["patch_size"]
    # a config that leaves out all but the tile side (HF's default 224 is 7 patches, which a pixel
    # shuffle by 2 cannot divide): the same image token and tokens per tile as the engine reads
    bare = {"architectures": ["Idefics3ForConditionalGeneration"], "vision_config": {"image_size": 256}}
    ours = read_vision_prompt(model_dir(tmp_path, {"max_image_size": {"longest_edge": 256}}), bare)
    theirs = idefics3.Idefics3().model_config({**bare, "text_config": TINY_TEXT})
    assert (ours.image_token_id, ours.settings.image_seq_len) == (theirs.image_token_id, theirs.image_seq_len)
    assert ours.patches_per_tile == theirs.vision.patches_per_side**2


TINY_TEXT = {
    "vocab_size": 128300,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
}
