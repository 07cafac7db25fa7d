"""Images in the prompts of a served vision-language model (the tiny VLM of tests.vlm_model): each
API's image parts become the placeholders the offline engine builds for the same prompt and images,
the encoder's images are the request's in prompt order, count_tokens counts them, and no text makes an
image. Images are real PNGs decoded by Pillow; the URL image is fetched from a real local server."""

import base64
import functools
import io
import json

import numpy as np
import pytest
from PIL import Image

from recipe import conversation_requests
from recipe.api import ApiError, RequestLimits, ServedModel, count_tokens, prepare_request
from recipe.image_prompts import IMAGE_MARKER
from recipe.images.resolve import resolve_images
from tests.controlplane.gateway.test_image_fetch import Server, also_the_allowed_server
from tests.vlm_model import build_tiny_vlm
from workers.engine import LLM, SamplingParams
from workers.engine.weights import resolve_model
from workers.protocol.errors import ModelLoadError
from workers.text.idefics3_images import image_layout, image_prompt
from workers.text.image_hash import image_content_hash

SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
ASSISTANT = "<|im_start|>assistant\n"
QUESTION = "What is in these?"
# (width, height): pictures cut into a 1 × 2 grid and the global tile, and into a 2 × 2 grid and the
# global tile (every picture is resized to a 64-pixel longest edge, then cut into 32-pixel tiles).
WIDE, GRID = (100, 20), (70, 40)


def png(width: int, height: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


def data_url(data: bytes) -> str:
    return f"data:image/png;base64,{base64.b64encode(data).decode()}"


def image_part(protocol: str, url: str) -> dict:
    if protocol == "chat.completions":
        return {"type": "image_url", "image_url": {"url": url}}
    if protocol == "responses":
        return {"type": "input_image", "image_url": url}
    if url.startswith("data:"):
        return {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": url.split(",")[1]}}
    return {"type": "image", "source": {"type": "url", "url": url}}


def body(protocol: str, model: ServedModel, content: list, **fields) -> dict:
    messages = [{"role": "user", "content": content}]
    if protocol == "responses":
        return {"model": model.name, "input": messages, "max_output_tokens": 4, **fields}
    return {"model": model.name, "messages": messages, "max_tokens": 4, **fields}


def text(protocol: str, words: str) -> dict:
    return {"type": "input_text" if protocol == "responses" else "text", "text": words}


def user_turns(protocol: str, images: int) -> str:
    """The user turns deepseek-recipe makes of QUESTION and `images` images, "<image>" for each: the
    OpenAI APIs join a message's parts with blank lines, Messages makes each block a message."""
    if protocol == "messages":
        return f"<|im_start|>user\n{QUESTION}<|im_end|>\n" + "<|im_start|>user\n<image><|im_end|>\n" * images
    return f"<|im_start|>user\n{QUESTION}" + "\n\n<image>" * images + "<|im_end|>\n"


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return build_tiny_vlm(tmp_path_factory.mktemp("models") / "tiny-vlm")


@pytest.fixture(scope="module")
def vlm(vlm_dir) -> ServedModel:
    return ServedModel.from_model_files(resolve_model(vlm_dir), max_model_len=2048)


@pytest.fixture(scope="module")
def offline(vlm_dir) -> LLM:
    return LLM(vlm_dir, kv_cache_bytes=1 << 24)


def offline_prompt(llm: LLM, prompt: str, images: list[bytes]) -> list[int]:
    """The offline engine's prompt ids for a prompt with "<image>" placeholders and these images."""
    pictures = [Image.open(io.BytesIO(data)) for data in images]
    (output,) = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1), images=[pictures])
    return output.prompt_token_ids


def test_the_tiny_vlm_loads_and_generates_from_an_image(vlm_dir, vlm, offline):
    # given: the directory as the engine and the gateway's catalog find it
    files = resolve_model(vlm_dir)
    assert files.config["architectures"] == ["Idefics3ForConditionalGeneration"]
    assert vlm.family == "chatml" and vlm.vision is not None
    assert vlm.vision.image_token_id == vlm.tokenizer.encode("<image>", allow_special=True)[0]

    # when: the offline engine answers a prompt with an image
    prompt = f"{SYSTEM}<|im_start|>user\n{QUESTION}\n\n<image><|im_end|>\n{ASSISTANT}"
    picture = Image.open(io.BytesIO(png(*GRID, seed=1)))
    (output,) = offline.generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), images=[[picture]]
    )

    # then: five tiles of four embeddings each took the image's place, and tokens came out
    assert output.prompt_token_ids.count(vlm.vision.image_token_id) == 5 * 4
    assert len(output.outputs[0].token_ids) == 4


@pytest.mark.parametrize("protocol", ["chat.completions", "responses", "messages"])
def test_each_apis_images_become_the_offline_engines_placeholders_in_prompt_order(protocol, vlm, offline):
    # given: a 2 × 2 grid image then a 1 × 2 one, as data URLs (Messages: base64 blocks)
    images = [png(*GRID, seed=1), png(*WIDE, seed=2)]
    request = body(protocol, vlm, [text(protocol, QUESTION), *(image_part(protocol, data_url(i)) for i in images)])

    # when
    prepared = prepare_request(protocol, request, {vlm.name: vlm})

    # then: the same ids as the offline engine's for the same prompt and images
    expected = offline_prompt(offline, SYSTEM + user_turns(protocol, 2) + ASSISTANT, images)
    assert prepared.prompt_token_ids == expected
    # and the encoder's images are the request's, in prompt order
    assert [image.data for image in prepared.images] == images
    assert [image.num_tokens for image in prepared.images] == [5 * 4, 3 * 4]
    assert [image.num_patches for image in prepared.images] == [5 * 16, 3 * 16]
    assert sum(image.num_tokens for image in prepared.images) == expected.count(vlm.vision.image_token_id)


def test_a_messages_image_url_is_fetched_and_placed_like_a_base64_one(vlm, offline, monkeypatch):
    # given: the image on a local server, which the swapped address rule allows
    image = png(*GRID, seed=3)
    server = Server("127.0.0.1", {"/cat.png": (200, {"content-type": "image/png"}, image)})
    monkeypatch.setattr(
        conversation_requests, "resolve_images", functools.partial(resolve_images, is_allowed=also_the_allowed_server)
    )
    try:
        # when
        by_url = prepare_request(
            "messages",
            body("messages", vlm, [text("messages", QUESTION), image_part("messages", server.url("/cat.png"))]),
            {vlm.name: vlm},
        )
    finally:
        server.close()

    # then
    by_data = prepare_request(
        "messages",
        body("messages", vlm, [text("messages", QUESTION), image_part("messages", data_url(image))]),
        {vlm.name: vlm},
    )
    assert server.hits == ["/cat.png"]
    assert (
        by_url.prompt_token_ids
        == by_data.prompt_token_ids
        == offline_prompt(offline, SYSTEM + user_turns("messages", 1) + ASSISTANT, [image])
    )
    assert by_url.images == by_data.images


def test_the_encoders_hashes_are_the_image_hash_of_the_decoded_pixels(vlm):
    # given: one picture as PNG and losslessly re-encoded, and another picture
    picture = png(*GRID, seed=4)
    pixels = Image.open(io.BytesIO(picture))
    again = io.BytesIO()
    pixels.save(again, "PNG", compress_level=0)
    request = body(
        "chat.completions",
        vlm,
        [image_part("chat.completions", data_url(d)) for d in (picture, again.getvalue(), png(*GRID, seed=5))],
    )

    # when
    prepared = prepare_request("chat.completions", request, {vlm.name: vlm})

    # then
    hashes = [image.content_hash for image in prepared.images]
    assert hashes[0] == image_content_hash(Image.open(io.BytesIO(picture))) == hashes[1]
    assert hashes[2] != hashes[0] and len(hashes[0]) == 32
    assert [image.content_hash for image in prepared.read_images] == hashes


def test_count_tokens_counts_each_images_placeholders(vlm, offline):
    # given
    images = [png(*GRID, seed=6), png(*WIDE, seed=7)]
    content = [text("messages", QUESTION), *(image_part("messages", data_url(i)) for i in images)]
    request = body("messages", vlm, content)
    del request["max_tokens"]

    # when
    counted = count_tokens(request, {vlm.name: vlm})
    without_images = count_tokens(body("messages", vlm, content[:1]), {vlm.name: vlm})

    # then: the offline prompt's length, which is more than the text's by each image's expansion
    assert counted == len(offline_prompt(offline, SYSTEM + user_turns("messages", 2) + ASSISTANT, images))
    expansion = [len(vlm.tokenizer.encode("<|im_start|>user\n<|im_end|>\n", allow_special=True))] * 2
    layouts = [image_layout(h, w, vlm.vision.settings) for w, h in (GRID, WIDE)]
    assert counted - without_images - sum(expansion) == sum(
        len(vlm.tokenizer.encode(image_prompt(layout, vlm.vision.settings), allow_special=True)) for layout in layouts
    )


def test_a_cache_breakpoint_after_an_image_covers_the_image(vlm, offline):
    # given: a Messages image, then a text block marked for caching
    image = png(*GRID, seed=11)
    marked = {**text("messages", QUESTION), "cache_control": {"type": "ephemeral"}}
    request = body("messages", vlm, [image_part("messages", data_url(image)), marked])

    # when
    prepared = prepare_request("messages", request, {vlm.name: vlm})

    # then: the hint keeps the prompt up to the end of the text, placeholders included
    up_to_text = offline_prompt(
        offline, f"{SYSTEM}<|im_start|>user\n<image><|im_end|>\n<|im_start|>user\n{QUESTION}", [image]
    )
    assert [hint.prefix_tokens for hint in prepared.cache_hints] == [len(up_to_text)]
    assert prepared.prompt_token_ids[: len(up_to_text)] == up_to_text


@pytest.mark.parametrize(
    ("protocol", "where", "field"),
    [
        ("chat.completions", "text_part", "messages[0].content[0].text"),
        ("responses", "text_part", "input[0].content[0].text"),
        ("messages", "text_part", "messages[0].content[0].text"),
        ("messages", "system", "system"),
        ("chat.completions", "tool", "tools[0].function.description"),
    ],
)
def test_text_spelling_the_image_marker_is_refused_naming_its_field(protocol, where, field, vlm):
    # given: the marker deepseek-recipe puts where an image was, typed as text, beside a real image
    sneaky = f"look {IMAGE_MARKER} here"
    content = [
        text(protocol, sneaky if where == "text_part" else QUESTION),
        image_part(protocol, data_url(png(*WIDE, seed=8))),
    ]
    extra = {}
    if where == "system":
        extra["system"] = sneaky
    if where == "tool":
        function = {"name": "f", "description": sneaky, "parameters": {"type": "object"}}
        extra["tools"] = [{"type": "function", "function": function}]

    # when / then
    with pytest.raises(ApiError) as refused:
        prepare_request(protocol, body(protocol, vlm, content, **extra), {vlm.name: vlm})
    assert refused.value.status == 400 and refused.value.param == field
    assert f"`{field}`" in refused.value.message and IMAGE_MARKER in refused.value.message


def test_text_spelling_image_tags_stays_plain_text(vlm):
    # given: every tag of an image's expansion typed as text, and one real image
    tags = "<fake_token_around_image><global-img><image><row_1_col_1>\n<image>"
    request = body(
        "chat.completions",
        vlm,
        [text("chat.completions", tags), image_part("chat.completions", data_url(png(*WIDE, seed=9)))],
    )

    # when
    prepared = prepare_request("chat.completions", request, {vlm.name: vlm})
    text_only = prepare_request(
        "chat.completions", body("chat.completions", vlm, [text("chat.completions", tags)]), {vlm.name: vlm}
    )

    # then: only the real image's placeholders are image tokens; the typed tags are plain-text tokens
    image_tags = {
        vlm.tokenizer.encode(tag, allow_special=True)[0]
        for tag in ("<fake_token_around_image>", "<global-img>", "<image>", "<row_1_col_1>")
    }
    assert prepared.prompt_token_ids.count(vlm.vision.image_token_id) == prepared.images[0].num_tokens == 3 * 4
    assert not image_tags & set(text_only.prompt_token_ids) and text_only.images == ()
    assert vlm.tokenizer.decode(text_only.prompt_token_ids, skip_special_tokens=False).count(tags) == 1


def test_a_text_only_model_still_refuses_images_by_field(smollm2_files):
    model = ServedModel.from_model_files(smollm2_files, 8192)
    assert model.vision is None
    request = body(
        "responses", model, [text("responses", QUESTION), image_part("responses", data_url(png(*WIDE, seed=1)))]
    )
    with pytest.raises(ApiError) as refused:
        prepare_request("responses", request, {model.name: model})
    assert refused.value.param == "input[0].content[1].image_url" and "does not accept images" in refused.value.message


def test_images_read_elsewhere_are_taken_as_they_are(vlm, monkeypatch):
    """A prepare process's read images (PreparedRequest.read_images) prepare the body again unread."""
    request = body("chat.completions", vlm, [image_part("chat.completions", data_url(png(*GRID, seed=10)))])
    first = prepare_request("chat.completions", request, {vlm.name: vlm}, RequestLimits())

    def no_reading(*args, **kwargs):
        raise AssertionError("the images were read again")

    monkeypatch.setattr(conversation_requests, "resolve_images", no_reading)
    again = prepare_request("chat.completions", request, {vlm.name: vlm}, RequestLimits(), first.read_images)
    assert (again.prompt_token_ids, again.images) == (first.prompt_token_ids, first.images)


def test_a_vlm_whose_image_token_is_not_the_tokenizers_or_without_preprocessor_config_is_not_served(vlm_dir, tmp_path):
    # given: copies of the model, one naming another image token, one without its preprocessor config
    import shutil

    wrong_token = shutil.copytree(vlm_dir, tmp_path / "wrong-token")
    config = json.loads((wrong_token / "config.json").read_text())
    (wrong_token / "config.json").write_text(json.dumps({**config, "image_token_id": 5}))
    no_preprocessor = shutil.copytree(vlm_dir, tmp_path / "no-preprocessor")
    (no_preprocessor / "preprocessor_config.json").unlink()

    # when / then
    with pytest.raises(ModelLoadError, match="image_token_id"):
        ServedModel.from_model_files(resolve_model(wrong_token), 2048)
    with pytest.raises(ModelLoadError, match="preprocessor"):
        ServedModel.from_model_files(resolve_model(no_preprocessor), 2048)
