"""Idefics3 / SmolVLM image preprocessing and prompt expansion against HF's Idefics3 processor
(its Pillow backend) on synthetic images of several sizes, aspect ratios and modes."""

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from workers.text.idefics3_images import (
    ImageSettings,
    expand_image_placeholders,
    image_layout,
    image_prompt,
    num_image_tokens,
    preprocess_image,
)
from workers.text.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

SMOLLM2_TOKENIZER = Path.home() / ".cache/sluice/models/smollm2-135m-instruct/tokenizer.json"
# Small tiles so that tests are fast: a 96-pixel longest edge cut into tiles of 32 (up to 3 × 3).
SETTINGS = ImageSettings(longest_edge=96, tile_side=32, image_seq_len=4)
HF_SIZES = {"size": {"longest_edge": 96}, "max_image_size": {"longest_edge": 32}}
# (width, height, mode): landscape, portrait, square, tiny, one that fits one tile, odd sizes.
IMAGES = [
    (200, 90, "RGB"),
    (45, 130, "RGB"),
    (64, 64, "RGB"),
    (7, 3, "RGB"),
    (33, 100, "RGBA"),
    (120, 31, "L"),
    (97, 96, "P"),
]


def synthetic_image(width: int, height: int, mode: str, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    if mode == "RGBA":
        return Image.fromarray(rng.integers(0, 256, (height, width, 4), dtype=np.uint8), "RGBA")
    if mode == "L":
        return Image.fromarray(rng.integers(0, 256, (height, width), dtype=np.uint8), "L")
    image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")
    return image.convert("P") if mode == "P" else image


def hf_image_processor(**overrides):
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    return Idefics3ImageProcessorPil(**{**HF_SIZES, **overrides})


@pytest.mark.parametrize(("width", "height", "mode"), IMAGES)
@pytest.mark.parametrize("split", [True, False])
def test_pixel_values_and_grid_match_hf(width, height, mode, split):
    image = synthetic_image(width, height, mode)
    settings = ImageSettings(longest_edge=96, tile_side=32, image_seq_len=4, split_images=split)

    ours, layout = preprocess_image(image, settings)

    expected = hf_image_processor(do_image_splitting=split)(images=[image], return_row_col_info=True)
    assert (layout.rows, layout.cols) == (expected["rows"][0][0], expected["cols"][0][0])
    assert ours.dtype == np.float32
    np.testing.assert_allclose(ours, np.asarray(expected["pixel_values"][0]), atol=1e-6, rtol=0)


def test_the_layout_from_the_image_size_alone_matches_hf_counts():
    """What the gateway counts without pixels: the grid HF's processor reports for a sweep of sizes."""
    processor = hf_image_processor()

    for height in range(1, 300, 7):
        for width in range(1, 300, 11):
            patches, rows, cols = processor.get_number_of_image_patches(height, width)
            layout = image_layout(height, width, SETTINGS)
            assert (layout.rows, layout.cols) == (rows, cols)
            assert layout.num_tiles == max(patches, 1)


@pytest.fixture(scope="module")
def tokenizers_pair(tmp_path_factory):
    """HF's processor with a tokenizer holding Idefics3's special tokens, and ours on the same file."""
    if not SMOLLM2_TOKENIZER.exists():
        pytest.skip("the packaged SmolLM2 tokenizer is not here")
    from transformers import PreTrainedTokenizerFast
    from transformers.models.idefics3.processing_idefics3 import Idefics3Processor

    hf_tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(SMOLLM2_TOKENIZER))
    markers = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
    markers += [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
    hf_tokenizer.add_tokens(markers, special_tokens=True)
    directory = tmp_path_factory.mktemp("tokenizer")
    hf_tokenizer.save_pretrained(directory)
    processor = Idefics3Processor(hf_image_processor(), hf_tokenizer, image_seq_len=SETTINGS.image_seq_len)
    ours = Tokenizer.from_model_files(
        SimpleNamespace(
            directory=directory,
            tokenizer_file=directory / "tokenizer.json",
            tokenizer_config={},
            generation_config={},
        )
    )
    return processor, ours


def test_expanded_prompt_tokens_match_hf(tokenizers_pair):
    processor, tokenizer = tokenizers_pair
    images = [synthetic_image(w, h, mode, seed) for seed, (w, h, mode) in enumerate(IMAGES[:4])]
    prompt = "User:<image>What is this?\n<image>And this?<image><image><end_of_utterance>\nAssistant:"

    layouts = [preprocess_image(image, SETTINGS)[1] for image in images]
    ours = tokenizer.encode(expand_image_placeholders(prompt, layouts, SETTINGS), allow_special=True)

    expected = processor(text=prompt, images=images)["input_ids"][0]
    assert ours == expected
    assert ours.count(processor.image_token_id) == sum(layout.num_tiles for layout in layouts) * SETTINGS.image_seq_len


def test_image_token_counts_without_encoding(tokenizers_pair):
    _, tokenizer = tokenizers_pair
    double_newline = len(tokenizer.encode("\n\n"))

    for height, width in [(90, 200), (130, 45), (64, 64), (3, 7), (100, 33), (31, 120)]:
        layout = image_layout(height, width, SETTINGS)
        encoded = tokenizer.encode(image_prompt(layout, SETTINGS), allow_special=True)
        assert num_image_tokens(layout, SETTINGS, double_newline_tokens=double_newline) == len(encoded)


def test_a_placeholder_count_unlike_the_images_is_refused():
    layout = image_layout(10, 10, SETTINGS)

    with pytest.raises(ValueError, match="2 <image> placeholders for 1 images"):
        expand_image_placeholders("<image><image>", [layout], SETTINGS)


def test_settings_read_from_a_preprocessor_config():
    settings = ImageSettings.from_hf(
        {"size": {"longest_edge": 2048}, "max_image_size": {"longest_edge": 512}, "resample": 1}, image_seq_len=64
    )

    assert (settings.longest_edge, settings.tile_side, settings.resample) == (2048, 512, 1)
    with pytest.raises(ValueError, match="do_normalize=False"):
        ImageSettings.from_hf({"do_normalize": False}, image_seq_len=64)
