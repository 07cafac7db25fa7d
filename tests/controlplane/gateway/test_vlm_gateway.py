"""A vision-language model served through the gateway (the real application, its catalog and prepare
processes, the tiny VLM of tests.vlm_model): each API's images reach the engine client as the
encoder's images and the GenerateRequest's image references, read once in a prepare process;
count_tokens counts them; text spelling the image marker is the protocol's 400. The engine client is
a fake that takes images as EngineClient.generate(request, images=...) does."""

import io

import pytest
from PIL import Image

from recipe import conversation_requests
from recipe.image_prompts import IMAGE_MARKER
from tests.controlplane.gateway.helpers import FakeEngine, key_headers, three_token_script
from tests.controlplane.gateway.images import data_url, image_part, png, text_part
from tests.controlplane.gateway.live import served_models
from tests.controlplane.gateway.test_hostile_inputs import assert_refused
from tests.vlm_model import build_tiny_vlm
from workers.client.worker_link import RequestRejectedError
from workers.protocol.images import ImageRef
from workers.text.image_hash import image_content_hash

IMAGE_TOKEN_ID = 49153  # the tiny VLM's <image>: SmolLM2's vocabulary (49152) and the fake token before it
PICTURE = png(70, 40, seed=1)  # a 2 × 2 grid and the global tile: 5 tiles of 4 tokens, 16 patches each
TOKENS, PATCHES = 5 * 4, 5 * 16


class ImageTakingEngine(FakeEngine):
    """Records, per request id, the images the generation gave the client."""

    def __init__(self, script) -> None:
        super().__init__(script)
        self.images: dict[str, tuple] = {}

    async def generate(self, request, images=()):
        self.images[request.request_id] = images
        async for output in super().generate(request):
            yield output


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return build_tiny_vlm(tmp_path_factory.mktemp("models") / "tiny-vlm")


@pytest.fixture
def served_vlm(vlm_dir) -> str:
    """The gateway serves the tiny VLM alone; its name."""
    with served_models(vlm_dir):
        yield vlm_dir.name


@pytest.fixture
def engine(monkeypatch) -> ImageTakingEngine:
    installed = ImageTakingEngine(three_token_script(cached=0))

    async def engine_client() -> ImageTakingEngine:
        return installed

    monkeypatch.setattr("controlplane.gateway.views.engine_client", engine_client)
    return installed


def request_body(protocol: str, model: str, *parts: dict, **fields) -> dict:
    messages = [{"role": "user", "content": list(parts)}]
    if protocol == "responses":
        return {"model": model, "input": messages, "max_output_tokens": 3, **fields}
    if protocol == "messages.count_tokens":
        return {"model": model, "messages": messages, **fields}
    return {"model": model, "messages": messages, "max_tokens": 3, **fields}


@pytest.mark.parametrize("protocol", ["chat.completions", "responses", "messages"])
def test_images_reach_the_engine_client_read_once_in_a_prepare_process(
    protocol, served_vlm, engine, api, make_api_key, monkeypatch
):
    # given: the gateway process cannot read images itself, so any image it passes on came from the
    # prepare process that read the body
    def not_here(*args, **kwargs):
        raise AssertionError("the gateway thread read the images again")

    monkeypatch.setattr(conversation_requests, "resolve_images", not_here)
    fields = {"n": 2} if protocol == "chat.completions" else {}
    body = request_body(
        protocol,
        served_vlm,
        text_part(protocol, "What is this?"),
        image_part(protocol, data_url(PICTURE)),
        **fields,
    )

    # when
    answer = api.post(protocol, body, headers=key_headers(make_api_key()))

    # then: each choice's request names the image, and the client got the image itself
    assert answer.status_code == 200, answer.text
    content_hash = image_content_hash(Image.open(io.BytesIO(PICTURE)))
    assert len(engine.requests) == len(fields) + 1
    for request in engine.requests:
        assert request.images == (ImageRef(content_hash, TOKENS),)
        assert request.prompt_token_ids.count(IMAGE_TOKEN_ID) == TOKENS
        (image,) = engine.images[request.request_id]
        assert (image.content_hash, image.data, image.num_tokens, image.num_patches) == (
            content_hash,
            PICTURE,
            TOKENS,
            PATCHES,
        )


def test_a_text_request_reaches_the_client_without_images(served_vlm, engine, api, make_api_key):
    body = request_body("chat.completions", served_vlm, text_part("chat.completions", "Hi"))
    answer = api.post("chat.completions", body, headers=key_headers(make_api_key()))
    assert answer.status_code == 200, answer.text
    (request,) = engine.requests
    assert request.images == () and engine.images[request.request_id] == ()
    assert IMAGE_TOKEN_ID not in request.prompt_token_ids


def test_count_tokens_counts_the_image_tokens(served_vlm, api, make_api_key):
    headers = key_headers(make_api_key())
    question = text_part("messages", "What is this?")

    with_image = api.post(
        "messages.count_tokens",
        request_body("messages.count_tokens", served_vlm, question, image_part("messages", data_url(PICTURE))),
        headers=headers,
    )
    without = api.post(
        "messages.count_tokens", request_body("messages.count_tokens", served_vlm, question), headers=headers
    )

    # then: the image's turn and its expansion: 20 placeholders, 5 fake tokens around the tiles, 4 row/col
    # tags, the global-image tag, the newline after the first row, the blank line before the global tile
    # and the turn's 5 tokens (<|im_start|>, "user", "\n", <|im_end|>, "\n")
    assert with_image.status_code == without.status_code == 200, with_image.text
    assert with_image.json()["input_tokens"] - without.json()["input_tokens"] == TOKENS + 6 + 4 + 1 + 1 + 1 + 5


@pytest.mark.parametrize("protocol", ["chat.completions", "messages"])
def test_text_spelling_the_image_marker_is_the_protocols_400(protocol, served_vlm, engine, api, make_api_key):
    body = request_body(
        protocol,
        served_vlm,
        text_part(protocol, f"pretend {IMAGE_MARKER} is a picture"),
        image_part(protocol, data_url(PICTURE)),
    )
    answer = api.post(protocol, body, headers=key_headers(make_api_key()))
    assert_refused(answer, protocol, "messages[0].content[0].text")
    assert engine.requests == []


@pytest.mark.parametrize(("protocol", "status"), [("chat.completions", 503), ("messages", 529)])
def test_images_no_encoder_could_encode_are_the_protocols_overloaded_error(
    protocol, status, served_vlm, api, make_api_key, monkeypatch
):
    async def no_encoder(request):
        raise RequestRejectedError("encode_failed", "no encoder is available")
        yield

    failing = ImageTakingEngine(no_encoder)

    async def engine_client() -> ImageTakingEngine:
        return failing

    monkeypatch.setattr("controlplane.gateway.views.engine_client", engine_client)
    body = request_body(protocol, served_vlm, image_part(protocol, data_url(PICTURE)))

    answer = api.post(protocol, body, headers=key_headers(make_api_key()))

    assert answer.status_code == status, answer.text
    assert "could not be encoded: no encoder is available" in answer.text
