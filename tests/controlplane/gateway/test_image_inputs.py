"""Image inputs in Chat Completions, Responses and Messages: where they are read from, the limits on
them, and their refusals in each protocol's shape. Decoding is Pillow's on real files; no mocks."""

import pytest

from controlplane.gateway.catalog import load_catalog
from controlplane.gateway.errors import GatewayError
from controlplane.gateway.prepare_jobs import PrepareJob
from controlplane.gateway.prepare_pool import PrepareProcess
from recipe.api import ApiError, RequestLimits, count_tokens
from recipe.images.parts import DataImage, UrlImage, image_parts
from recipe.images.resolve import resolve_images
from tests.controlplane.gateway.helpers import key_headers, valid_body
from tests.controlplane.gateway.images import (
    body_with_images,
    bomb_png,
    data_url,
    image_field,
    png,
    truncated_png,
)
from tests.controlplane.gateway.test_hostile_inputs import assert_refused

CONVERSATION_PROTOCOLS = ["chat.completions", "responses", "messages"]


def refusal(protocol: str, body: dict, limits: RequestLimits = RequestLimits()) -> ApiError:
    with pytest.raises(ApiError) as refused:
        resolve_images(protocol, body, limits)
    assert refused.value.status == 400 and refused.value.type == "invalid_request_error"
    return refused.value


def test_each_protocols_image_parts_are_read_in_prompt_order_with_their_fields():
    # given: one image of each kind per protocol, and the detail each may carry
    chat = valid_body(
        "chat.completions",
        messages=[
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": data_url(png()), "detail": "low"}},
                    {"type": "text", "text": "and"},
                    {"type": "image_url", "image_url": {"url": "https://example.com/a.png", "detail": "high"}},
                ],
            },
        ],
    )
    responses = valid_body(
        "responses",
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": "http://example.com/b.jpg", "detail": "auto"},
                    {"type": "input_image", "image_url": data_url(png(), "image/webp")},
                ],
            }
        ],
    )
    anthropic = valid_body(
        "messages",
        messages=[
            {"role": "user", "content": "first"},
            {"role": "assistant", "content": "ok"},
            {
                "role": "user",
                "content": [
                    {"type": "image", "source": {"type": "url", "url": "https://example.com/c.gif"}},
                    {
                        "type": "tool_result",
                        "tool_use_id": "t",
                        "content": [body_with_images("messages", data_url(png()))["messages"][0]["content"][1]],
                    },
                ],
            },
        ],
    )

    # when
    read = {
        protocol: image_parts(protocol, body)
        for protocol, body in [("chat.completions", chat), ("responses", responses), ("messages", anthropic)]
    }

    # then
    assert [(p.field, type(p.source), p.detail) for p in read["chat.completions"]] == [
        ("messages[1].content[0].image_url.url", DataImage, "low"),
        ("messages[1].content[2].image_url.url", UrlImage, "high"),
    ]
    assert [(p.field, type(p.source), p.detail) for p in read["responses"]] == [
        ("input[0].content[0].image_url", UrlImage, "auto"),
        ("input[0].content[1].image_url", DataImage, "auto"),
    ]
    assert read["responses"][1].source.media_type == "image/webp"
    assert [(p.field, type(p.source)) for p in read["messages"]] == [
        ("messages[2].content[0].source", UrlImage),
        ("messages[2].content[1].content[0].source", DataImage),
    ]


def test_the_same_picture_has_one_hash_whatever_carries_it_and_another_picture_another():
    # given: one picture as a Chat data URL, a Responses data URL, an Anthropic base64 block, and
    # re-encoded at another compression level; and a different picture
    picture, other = png(seed=1), png(seed=2)
    recompressed = png(seed=1, compress_level=0)
    assert recompressed != picture

    # when
    chat = resolve_images(
        "chat.completions", body_with_images("chat.completions", data_url(picture), data_url(other)), RequestLimits()
    )
    responses = resolve_images("responses", body_with_images("responses", data_url(recompressed)), RequestLimits())
    anthropic = resolve_images("messages", body_with_images("messages", data_url(picture)), RequestLimits())

    # then
    assert chat[0].content_hash == responses[0].content_hash == anthropic[0].content_hash
    assert chat[1].content_hash != chat[0].content_hash
    assert (chat[0].width, chat[0].height, chat[0].data) == (8, 6, picture)
    assert anthropic[0].field == "messages[0].content[1].source"


@pytest.mark.parametrize("protocol", CONVERSATION_PROTOCOLS)
def test_more_images_than_allowed_are_refused_naming_the_first_past_the_limit(protocol):
    body = body_with_images(protocol, *[data_url(png(seed=i)) for i in range(3)])
    error = refusal(protocol, body, RequestLimits(max_images=2))
    assert error.param == image_field(protocol, 2) and "3 images; at most 2" in error.message


@pytest.mark.parametrize("protocol", CONVERSATION_PROTOCOLS)
@pytest.mark.parametrize(
    ("image", "limits", "says"),
    [
        (png(64, 64), RequestLimits(max_image_bytes=1000), "more than 1000 bytes"),
        (png(64, 64), RequestLimits(max_image_pixels=4095), "more than 4095 pixels"),
        (bomb_png(), RequestLimits(), "pixels"),
        (truncated_png(), RequestLimits(), "truncated"),
        (b"<html><body>not an image</body></html>", RequestLimits(), "is not a PNG, JPEG, GIF or WEBP image"),
    ],
    ids=["oversized", "too-many-pixels", "decompression-bomb", "truncated", "not-an-image"],
)
def test_bad_images_are_refused_naming_their_field(protocol, image, limits, says):
    error = refusal(protocol, body_with_images(protocol, data_url(image)), limits)
    assert error.param == image_field(protocol, 0) and f"`{error.param}`" in error.message
    assert says in error.message, error.message


def test_pillows_own_bomb_guard_is_set_from_the_pixels_limit_and_is_an_error():
    # given: an image of 10000 pixels, over a limit of 5000 (Pillow only warns below twice its limit)
    from PIL import Image

    error = refusal(
        "chat.completions",
        body_with_images("chat.completions", data_url(png(100, 100))),
        RequestLimits(max_image_pixels=5000),
    )
    assert "more than 5000 pixels" in error.message
    assert Image.MAX_IMAGE_PIXELS == 5000


@pytest.mark.parametrize(
    ("protocol", "part", "field", "says"),
    [
        (
            "chat.completions",
            {"type": "image_url", "image_url": {"url": "ftp://example.com/a.png"}},
            "messages[0].content[0].image_url.url",
            "http(s) URL or a data URL",
        ),
        (
            "chat.completions",
            {"type": "image_url", "image_url": {"url": "data:text/html;base64,PGh0bWw+"}},
            "messages[0].content[0].image_url.url",
            "image type",
        ),
        (
            "chat.completions",
            {"type": "image_url", "image_url": {"url": data_url(png()), "detail": "huge"}},
            "messages[0].content[0].detail",
            "`auto`, `low` or `high`",
        ),
        (
            "chat.completions",
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@@"}},
            "messages[0].content[0].image_url.url",
            "not valid base64",
        ),
        ("responses", {"type": "input_image", "file_id": "file-1"}, "input[0].content[0].image_url", "file_id"),
        (
            "messages",
            {"type": "image", "source": {"type": "base64", "media_type": "text/html", "data": "PGh0bWw+"}},
            "messages[0].content[0].source.media_type",
            "image type",
        ),
        (
            "messages",
            {"type": "image", "source": {"type": "file", "file_id": "f"}},
            "messages[0].content[0].source.type",
            "`base64` or `url`",
        ),
    ],
)
def test_malformed_image_parts_are_refused_naming_the_field(protocol, part, field, says):
    body = valid_body(
        protocol, **{"input" if protocol == "responses" else "messages": [{"role": "user", "content": [part]}]}
    )
    error = refusal(protocol, body)
    assert error.param == field and says in error.message, error


@pytest.mark.parametrize("protocol", [*CONVERSATION_PROTOCOLS, "messages.count_tokens"])
def test_through_the_gateway_images_are_refused_by_todays_text_models_and_bad_ones_by_field(
    api, make_api_key, protocol
):
    # given: a text-only model, and requests with a good image, a decompression bomb, and too many images
    headers = key_headers(make_api_key())
    good = body_with_images(protocol, data_url(png()))
    bomb = body_with_images(protocol, data_url(png()), data_url(bomb_png()))
    too_many = body_with_images(protocol, *[data_url(png(seed=i)) for i in range(17)])

    # when: each goes through the real application (and its prepare processes)
    answers = [api.post(protocol, body, headers=headers) for body in (good, bomb, too_many)]
    counted = api.post("messages.count_tokens", valid_body("messages.count_tokens"), headers=headers)

    # then: each is the protocol's 400 naming the image...
    assert_refused(answers[0], protocol, image_field(protocol, 0))
    assert "does not accept images" in answers[0].json()["error"]["message"]
    assert_refused(answers[1], protocol, image_field(protocol, 1))
    assert "pixels" in answers[1].json()["error"]["message"]
    assert_refused(answers[2], protocol, image_field(protocol, 16))
    # ...and a normal request is still served
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 0


def test_count_tokens_refuses_images_for_a_text_model_naming_the_image():
    with pytest.raises(ApiError) as refused:
        count_tokens(body_with_images("messages.count_tokens", data_url(png())), load_catalog().models)
    assert refused.value.param == "messages[0].content[1].source"
    assert "does not accept images" in refused.value.message


def test_bad_images_end_in_refusals_and_the_prepare_process_lives_on():
    # given: one prepare process, and jobs with a bomb, a truncated PNG and non-image data
    def job(image: bytes) -> PrepareJob:
        import json

        body = json.dumps(body_with_images("chat.completions", data_url(image))).encode()
        return PrepareJob("generation", "chat.completions", body, RequestLimits())

    with PrepareProcess(cpu_budget_s=10) as run:
        # when / then: each is refused naming the image, by the same process
        pids = set()
        for image, says in [
            (bomb_png(), "pixels"),
            (truncated_png(), "truncated"),
            (b"GIF89a" + b"\0" * 20, "corrupt"),
        ]:
            with pytest.raises(GatewayError) as refused:
                run(job(image))
            assert refused.value.param == "messages[0].content[1].image_url.url", refused.value
            assert says in refused.value.message or "not a PNG" in refused.value.message
            pids.add(run.__self__._process.pid)
        assert len(pids) == 1
        # a normal request is still prepared there
        plain = PrepareJob(
            "count_tokens",
            "messages.count_tokens",
            b'{"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "hi"}]}',
            RequestLimits(),
        )
        assert run(plain) > 0 and run.__self__._process.pid in pids
