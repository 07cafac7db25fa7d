"""Routing keys a prompt's blocks with its images as the engine does: the same keys as the engine's
for a prompt with two images, a store hit the engine then serves for the same images, and no hit
from the block where a different image starts."""

import asyncio

import numpy as np
import pytest
from PIL import Image

from tests.workers.engine.hf_idefics3_reference import IMAGE_TOKEN_ID, build_hf_idefics3
from workers.client.routing.prefix_match import PromptImageKeys, prompt_block_keys
from workers.client.store_hits import read_store_hit
from workers.engine import LLM, SamplingParams
from workers.engine.request import PromptImages, Request
from workers.kvstore.block_hash import namespace_extra
from workers.kvstore.store import open_store
from workers.protocol.images import ImageEmbeddings, ImageRef
from workers.protocol.messages import GenerateRequest, WorkerHeartbeat
from workers.text.idefics3_images import ImageSettings, image_layout
from workers.text.image_hash import image_content_hash

BLOCK = 16
EXTRA = namespace_extra("vlm:float32", "tenant")
# Two images of 5 and 3 placeholders, each as several runs (tiles) between other tokens, as the
# idefics3 layout has them; the first starts in block 1, the second in block 3.
IM = IMAGE_TOKEN_ID
PROMPT = [1] * 20 + [IM, IM, 7, IM, IM, IM] + [2] * 30 + [IM, 8, IM, IM] + [3] * 20
FIRST_START, SECOND_START = 20, 56


def refs(*hashes: bytes, counts=(5, 3)) -> tuple[ImageRef, ...]:
    return tuple(ImageRef(content_hash, count) for content_hash, count in zip(hashes, counts, strict=True))


def engine_keys(prompt: list[int], images: tuple[ImageRef, ...]) -> list[bytes]:
    """The keys the engine gives the prompt's blocks (its Request with PromptImages)."""
    embeddings = [
        ImageEmbeddings(content_hash=ref.content_hash, num_tokens=ref.num_tokens, dtype="float32", shape=(), data=b"")
        for ref in images
    ]
    request = Request("r", prompt, SamplingParams(), max_tokens=1, hash_extra=EXTRA)
    request.images = PromptImages.of(prompt, IMAGE_TOKEN_ID, embeddings)
    return request.block_keys(prompt, BLOCK)


A, B, C = (bytes([n]) * 32 for n in (1, 2, 3))


def test_the_client_keys_a_prompt_with_two_images_as_the_engine_does():
    images = refs(A, B)

    keys = PromptImageKeys.of(PROMPT, IMAGE_TOKEN_ID, images)
    client = prompt_block_keys(PROMPT, BLOCK, EXTRA, keys)

    assert keys.starts == (FIRST_START, SECOND_START)
    assert len(client) == len(PROMPT) // BLOCK == 5
    assert client == engine_keys(PROMPT, images)


def test_another_image_keys_apart_from_the_block_it_starts_in_and_the_text_before_it_does_not():
    same = prompt_block_keys(PROMPT, BLOCK, EXTRA, PromptImageKeys.of(PROMPT, IMAGE_TOKEN_ID, refs(A, B)))
    other_second = prompt_block_keys(PROMPT, BLOCK, EXTRA, PromptImageKeys.of(PROMPT, IMAGE_TOKEN_ID, refs(A, C)))
    other_first = prompt_block_keys(PROMPT, BLOCK, EXTRA, PromptImageKeys.of(PROMPT, IMAGE_TOKEN_ID, refs(C, B)))
    text = prompt_block_keys(PROMPT, BLOCK, EXTRA)

    assert other_second[:3] == same[:3] and all(a != b for a, b in zip(other_second[3:], same[3:]))
    assert other_first[:1] == same[:1] and all(a != b for a, b in zip(other_first[1:], same[1:]))
    # A prompt keyed as text (no images) shares only the block before the first image.
    assert text[:1] == same[:1] and all(a != b for a, b in zip(text[1:], same[1:]))
    # The same two images in the other order key apart too.
    swapped = PromptImageKeys.of(PROMPT, IMAGE_TOKEN_ID, refs(B, A))
    assert prompt_block_keys(PROMPT, BLOCK, EXTRA, swapped)[1:] != same[1:]


def test_placeholders_that_do_not_add_up_to_the_images_give_no_keys():
    assert PromptImageKeys.of(PROMPT, IMAGE_TOKEN_ID, refs(A, B, counts=(5, 4))) is None
    assert PromptImageKeys.of(PROMPT, IMAGE_TOKEN_ID, refs(A, counts=(8,))) is not None


SETTINGS = ImageSettings(longest_edge=64, tile_side=32, image_seq_len=4)
TEXT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28]


def picture(width: int, height: int, seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def image_prompt(*images: Image.Image) -> list[int]:
    """TEXT, then each image's placeholders (tiles of image_seq_len image tokens between other tokens)."""
    ids = list(TEXT)
    for image in images:
        layout = image_layout(image.height, image.width, SETTINGS)
        for _ in range(max(layout.rows * layout.cols, 0) + 1):
            ids += [118, 119, *[IMAGE_TOKEN_ID] * SETTINGS.image_seq_len]
        ids.append(42)
    return ids + [7, 9, 11]


def placeholders(image: Image.Image) -> int:
    layout = image_layout(image.height, image.width, SETTINGS)
    return SETTINGS.image_seq_len * (layout.rows * layout.cols + 1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("idefics3")
    build_hf_idefics3().save_pretrained(path)
    return path


def test_the_store_hit_routing_reads_is_what_the_engine_then_serves_for_the_same_images(model_dir, tmp_path):
    # given: a prompt with two images (one split in tiles) written to the store by the engine
    first, second, other = picture(60, 44, seed=1), picture(30, 20, seed=2), picture(30, 20, seed=3)
    prompt = image_prompt(first, second)
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    settings = {"seed": 0, "image_settings": SETTINGS, "kv_cache_bytes": 1 << 24}
    store = {"kv_store": tmp_path, "kv_block_tokens": BLOCK}
    writer = LLM(model_dir, **settings, **store)
    writer.generate([prompt], greedy, images=[[first, second]], cache_namespace="tenant")
    writer.close()
    worker = WorkerHeartbeat(
        worker_id="p",
        role="prefill",
        model="vlm",
        request_endpoint="ipc://p",
        max_model_len=256,
        num_running=0,
        num_waiting=0,
        kv_usage=0.0,
        num_free_pages=0,
        num_prompt_tokens=0,
        num_cached_prompt_tokens=0,
        num_preemptions=0,
        sent_at=0.0,
        kv_model_id=writer.engine.kv_model_id,
        kv_block_tokens=BLOCK,
        image_token_id=IMAGE_TOKEN_ID,
    )
    index = open_store(tmp_path).index

    def routed(images: list[Image.Image], beat: WorkerHeartbeat = worker) -> int:
        image_refs = tuple(ImageRef(image_content_hash(image), placeholders(image)) for image in images)
        request = GenerateRequest("r", prompt, greedy, cache_namespace="tenant", images=image_refs)
        return asyncio.run(read_store_hit(index, None, request, beat, {})).hit_tokens

    def served(images: list[Image.Image]) -> int:
        reader = LLM(model_dir, **settings, **store)
        try:
            return reader.generate([prompt], greedy, images=[images], cache_namespace="tenant")[0].num_cached_tokens
        finally:
            reader.close()

    # when routing reads the store for the same images, and for a different second image
    same, different = routed([first, second]), routed([first, other])

    # then: each is what the engine serves; the same images hit past both, the other image stops the
    # hit at the block where it starts
    assert same == served([first, second]) == (len(prompt) - 1) // BLOCK * BLOCK
    second_start = [i for i, token in enumerate(prompt) if token == IMAGE_TOKEN_ID][placeholders(first)]
    assert second_start // BLOCK > len(TEXT) // BLOCK  # the first image's blocks are shared
    assert different == served([first, other]) == second_start // BLOCK * BLOCK < same
    # A worker that does not name its image token is routed as a miss, never keyed as text.
    blind = WorkerHeartbeat(**{f: getattr(worker, f) for f in worker.__struct_fields__ if f != "image_token_id"})
    assert routed([first, second], blind) == 0
