"""Images through the engine (a tiny random Idefics3 saved as an HF directory): the offline LLM's
greedy tokens of image+text prompts against HF generate, with prefill chunks that cut through the
images, on the reference and the device path; prefix-cache and KV-store hits of the same image and
none past the block where a different image starts; image messages the engine refuses by field."""

import re

import numpy as np
import pytest
import torch
from PIL import Image

from tests.workers.engine.hf_idefics3_reference import IMAGE_TOKEN_ID, build_hf_idefics3
from tests.workers.engine.hf_reference import TINY_CONFIGS
from workers.engine import LLM, SamplingParams
from workers.engine.image_inputs import ImageEncoder
from workers.kvstore.block_hash import hash_chain, image_block_extra, image_digest
from workers.protocol.engine_request import EngineRequest
from workers.protocol.errors import InvalidRequestError
from workers.protocol.images import ImageEmbeddings
from workers.text.idefics3_images import ImageLayout, ImageSettings, image_layout, preprocess_image

FAKE_AROUND_IMAGE, GLOBAL_IMAGE, NEWLINE, FIRST_TILE_TAG = 118, 119, 10, 100
SETTINGS = ImageSettings(longest_edge=64, tile_side=32, image_seq_len=4)
PAGE_SIZE = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# Text before the image: the first page holds only text, so a different image still shares it.
PREFIX = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28]
SUFFIX = [7, 9, 11]


@pytest.fixture(scope="module")
def hf_model():
    return build_hf_idefics3()


@pytest.fixture(scope="module")
def model_dir(hf_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("idefics3")
    hf_model.save_pretrained(path)
    return path


def vlm(model_dir, **settings) -> LLM:
    settings = {"kv_cache_bytes": 1 << 24, "max_num_batched_tokens": 8, **settings}
    return LLM(model_dir, seed=0, image_settings=SETTINGS, **settings)


def picture(width: int, height: int, seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def placeholder_ids(layout: ImageLayout) -> list[int]:
    """The token ids of one image's expansion (idefics3_images.image_prompt) in the tiny vocabulary."""
    tile = [IMAGE_TOKEN_ID] * SETTINGS.image_seq_len
    global_tile = [FAKE_AROUND_IMAGE, GLOBAL_IMAGE, *tile, FAKE_AROUND_IMAGE]
    if not layout.rows:
        return global_tile
    ids: list[int] = []
    for row in range(layout.rows):
        for col in range(layout.cols):
            ids += [FAKE_AROUND_IMAGE, FIRST_TILE_TAG + row * layout.cols + col, *tile]
        ids.append(NEWLINE)
    return ids + [NEWLINE, *global_tile]


def image_prompt(*images: Image.Image) -> list[int]:
    ids = list(PREFIX)
    for image in images:
        ids += placeholder_ids(image_layout(image.height, image.width, SETTINGS)) + [42]
    return ids + SUFFIX


def hf_tokens(hf_model, prompt: list[int], images: list[Image.Image]) -> list[int]:
    tiles = np.concatenate([preprocess_image(image, SETTINGS)[0] for image in images])
    with torch.no_grad():
        out = hf_model.generate(
            input_ids=torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            pixel_values=torch.from_numpy(tiles)[None],
            max_new_tokens=GREEDY.max_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


SPLIT = picture(60, 44, seed=1)  # a 2 x 2 grid and the global tile
SMALL = picture(30, 20, seed=2)  # one tile
OTHER = picture(60, 44, seed=3)  # SPLIT's size, other pixels


def test_greedy_tokens_match_hf_with_chunks_cutting_through_images(hf_model, model_dir):
    prompt = image_prompt(SPLIT, SMALL)
    llm = vlm(model_dir)
    assert sum(t == IMAGE_TOKEN_ID for t in prompt) > 8  # 8-token chunks cut through the images

    (out,) = llm.generate([prompt], GREEDY, images=[[SPLIT, SMALL]])

    assert out.outputs[0].token_ids == hf_tokens(hf_model, prompt, [SPLIT, SMALL])


def test_the_same_image_hits_the_prefix_cache_with_the_same_tokens(hf_model, model_dir):
    prompt = image_prompt(SPLIT)
    llm = vlm(model_dir)

    first = llm.generate([prompt], GREEDY, images=[[SPLIT]])[0]
    again = llm.generate([prompt], GREEDY, images=[[SPLIT]])[0]

    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == (len(prompt) - 1) // PAGE_SIZE * PAGE_SIZE > len(PREFIX)
    assert again.outputs[0].token_ids == first.outputs[0].token_ids == hf_tokens(hf_model, prompt, [SPLIT])


def test_a_different_image_shares_no_block_from_its_own_on(hf_model, model_dir):
    prompt = image_prompt(SPLIT)
    assert prompt == image_prompt(OTHER)
    llm = vlm(model_dir)
    llm.generate([prompt], GREEDY, images=[[SPLIT]])

    other = llm.generate([prompt], GREEDY, images=[[OTHER]])[0]

    # Only the page before the one the image starts in is shared.
    assert other.num_cached_tokens == len(PREFIX) // PAGE_SIZE * PAGE_SIZE == PAGE_SIZE
    assert other.outputs[0].token_ids == hf_tokens(hf_model, prompt, [OTHER])


def test_the_kv_store_keys_blocks_by_their_images(hf_model, model_dir, tmp_path):
    prompt = image_prompt(SPLIT)
    store = {"kv_store": tmp_path, "kv_block_tokens": PAGE_SIZE}
    writer = vlm(model_dir, **store)
    expected = writer.generate([prompt], GREEDY, images=[[SPLIT]])[0].outputs[0].token_ids
    writer.close()

    reader = vlm(model_dir, **store)
    other = reader.generate([prompt], GREEDY, images=[[OTHER]])[0]
    same = reader.generate([prompt], GREEDY, images=[[SPLIT]])[0]
    reader.close()

    assert other.num_cached_tokens == PAGE_SIZE
    assert same.num_cached_tokens > len(PREFIX)
    assert same.outputs[0].token_ids == expected


def test_the_device_path_injects_the_images(hf_model, model_dir):
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("the CPU device path under Triton's interpreter")
    prompt = image_prompt(SMALL, SPLIT)
    llm = vlm(model_dir, attention_backend="triton", async_scheduling=True)

    (out,) = llm.generate([prompt], GREEDY, images=[[SMALL, SPLIT]])

    assert out.outputs[0].token_ids == hf_tokens(hf_model, prompt, [SMALL, SPLIT])


def test_a_text_prompt_expands_its_image_placeholders(model_dir):
    """Without a tokenizer the expansion is checked by its token count: the engine refuses a
    prompt whose placeholders do not match the images'."""
    llm = vlm(model_dir)
    with pytest.raises(InvalidRequestError, match="images: the prompt has 1 <image> placeholders for 2 images"):
        llm.generate(["<image> a cat"], GREEDY, images=[[SPLIT, SMALL]])


def embeddings_of(llm: LLM, image: Image.Image) -> ImageEmbeddings:
    return ImageEncoder(llm.engine.runner.model, SETTINGS).encode(image)[1]


def image_request(request_id: str, prompt: list[int], images: tuple[ImageEmbeddings, ...]) -> EngineRequest:
    return EngineRequest(request_id=request_id, prompt_token_ids=prompt, params=GREEDY, images=images)


def replaced(image: ImageEmbeddings, **fields) -> ImageEmbeddings:
    return ImageEmbeddings(**{**{f: getattr(image, f) for f in image.__struct_fields__}, **fields})


BAD_IMAGES = {
    # Consistent in itself, one token short of the prompt's placeholders.
    "count": (
        lambda e: replaced(e, num_tokens=e.num_tokens - 1, shape=(e.num_tokens - 1, e.shape[1]), data=e.data[256:]),
        "images: the prompt has",
    ),
    "bytes": (lambda e: replaced(e, data=e.data[:-4]), "images[0].data"),
    "dtype": (lambda e: replaced(e, dtype="float64"), "images[0].dtype"),
    "shape": (lambda e: replaced(e, shape=(e.num_tokens, 32)), "images[0].shape"),
    "hash": (lambda e: replaced(e, content_hash=b"x"), "images[0].content_hash"),
}


@pytest.mark.parametrize("case", BAD_IMAGES)
def test_bad_image_messages_are_refused_by_field_and_the_engine_serves_on(model_dir, case):
    llm = vlm(model_dir)
    prompt = image_prompt(SPLIT)
    good = embeddings_of(llm, SPLIT)
    change, field = BAD_IMAGES[case]

    with pytest.raises(InvalidRequestError, match=re.escape(field)):
        llm.engine.add_request(image_request("bad", prompt, (change(good),)))

    llm.engine.add_request(image_request("good", prompt, (good,)))
    tokens = []
    while llm.engine.has_unfinished():
        tokens += [t for delta in llm.engine.step() for t in delta.token_ids]
    assert len(tokens) == GREEDY.max_tokens


def test_placeholders_and_images_must_add_up(model_dir):
    llm = vlm(model_dir)
    good = embeddings_of(llm, SPLIT)
    with pytest.raises(InvalidRequestError, match="images: the prompt has .* placeholder tokens"):
        llm.engine.add_request(image_request("extra", image_prompt(SPLIT), (good, good)))
    with pytest.raises(InvalidRequestError, match="images: the prompt has .* placeholder tokens"):
        llm.engine.add_request(image_request("none", image_prompt(SPLIT), ()))


def test_a_text_only_model_refuses_images(model_dir):
    image = embeddings_of(vlm(model_dir), SMALL)
    text = LLM(TINY_CONFIGS["llama"], seed=0, kv_cache_bytes=1 << 22)

    with pytest.raises(InvalidRequestError, match="images: this model takes no images"):
        text.engine.add_request(image_request("img", [1, 2, IMAGE_TOKEN_ID, 3], (image,)))
    with pytest.raises(InvalidRequestError, match="images: this model takes no images"):
        text.generate([[1, 2, 3]], GREEDY, images=[[SMALL]])

    assert len(text.generate([[1, 2, 3]], GREEDY)[0].outputs[0].token_ids) == GREEDY.max_tokens


def test_a_preempted_image_request_recomputes_with_its_images(hf_model, model_dir):
    prompts = [image_prompt(SPLIT), image_prompt(OTHER)]
    llm = vlm(model_dir, num_pages=7, enable_prefix_caching=False)

    outs = llm.generate(prompts, GREEDY, images=[[SPLIT], [OTHER]])

    assert llm.engine.stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [
        hf_tokens(hf_model, prompts[0], [SPLIT]),
        hf_tokens(hf_model, prompts[1], [OTHER]),
    ]


def test_image_digests_enter_the_extra_from_their_block_on():
    x, y = image_digest(b"x" * 32), image_digest(b"y" * 32)
    base = b"model\x00tenant"

    def extras(*digests: bytes) -> list[bytes]:
        return [image_block_extra(base, (20, 40), digests, index, 16) for index in range(4)]

    # Blocks [0, 16) hold no image; X starts in block 1, Y in block 2.
    assert extras(x, y)[0] == base
    assert extras(x, y)[1] != base and extras(x, y)[1] == extras(x, x)[1]
    assert extras(x, y)[2] == extras(x, y)[3]  # every block after Y's carries both, in order
    assert len({extras(x, y)[2], extras(y, x)[2], extras(x, x)[2], extras(x, y)[1], extras(y, x)[1]}) == 5
    tokens = list(range(64))
    with_x = hash_chain(tokens[:16], 16, extras(x, y)[0]) + hash_chain(tokens[16:32], 16, extras(x, y)[1])
    assert with_x[0] == hash_chain(tokens, 16, base)[0] and with_x[1] != hash_chain(tokens, 16, base)[1]


ON_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize(
    "settings",
    [
        pytest.param({}, id="reference"),
        pytest.param({"attention_backend": "triton"}, id="device"),
        # CUDA graphs replay decode-shaped steps: the lone last token must not take one.
        pytest.param({"device": "cuda", "dtype": "float32"}, id="cuda-graphs", marks=ON_CUDA),
    ],
)
def test_a_prompt_ending_in_an_image_computes_its_last_placeholder_alone(hf_model, model_dir, settings):
    """A prompt whose last token is a placeholder, one token past whole pages: its second run hits
    every page, and the last placeholder runs alone in a step shaped like a decode."""
    if "attention_backend" in settings:
        pytest.importorskip("triton")
        if torch.cuda.is_available():
            pytest.skip("the CPU device path under Triton's interpreter")
    layout = placeholder_ids(image_layout(SPLIT.height, SPLIT.width, SETTINGS))[:-1]  # no closing marker
    filler = (-(len(PREFIX) + len(layout)) - 1) % PAGE_SIZE + 2
    prompt = PREFIX + [30] * filler + layout
    assert len(prompt) % PAGE_SIZE == 1 and prompt[-1] == IMAGE_TOKEN_ID
    llm = vlm(model_dir, max_num_batched_tokens=64, **settings)

    first, again = (llm.generate([prompt], GREEDY, images=[[SPLIT]])[0] for _ in range(2))

    assert again.num_cached_tokens == len(prompt) - 1
    expected = hf_tokens(hf_model, prompt, [SPLIT])
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == expected
