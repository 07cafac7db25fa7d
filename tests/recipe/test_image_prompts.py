"""recipe.image_prompts on its own: a rendered prompt's image markers become each image's expansion,
with the prompt's control-token spans and tool ends moved along, and text spelling the marker is
found wherever it is in a body."""

import re

import pytest

from recipe.api import ApiError
from recipe.chatml import PromptText
from recipe.image_prompts import IMAGE_MARKER, expand_images, refuse_marker_text
from recipe.images.resolve import RequestImage
from workers.text.idefics3_images import ImageSettings, image_layout, image_prompt
from workers.text.vision_prompt import VisionPrompt

VISION = VisionPrompt(
    image_token_id=7, settings=ImageSettings(longest_edge=64, tile_side=32, image_seq_len=1), patches_per_tile=16
)
TAG = re.compile(r"<fake_token_around_image>|<global-img>|<image>|<row_\d_col_\d>")


def image(width: int, height: int) -> RequestImage:
    return RequestImage("messages[0].content[1]", "auto", width, height, b"png", bytes(32))


def spans(text: str, ranges) -> list[str]:
    return [text[start:end] for start, end in ranges]


def test_markers_become_expansions_and_spans_and_ends_move_along():
    # given: two markers between control tokens, and tool ends after each
    text = f"S<|im_start|>A{IMAGE_MARKER}B<|im_end|>C{IMAGE_MARKER}D"
    start, end = text.index("<|im_start|>"), text.index("<|im_end|>")
    prompt = PromptText(
        text,
        ((start, start + len("<|im_start|>")), (end, end + len("<|im_end|>"))),
        tool_ends=(text.index("B") + 1,),
        tool_call_ends=(len(text),),
    )
    images = [image(40, 40), image(100, 20)]  # a 2 × 2 grid, a 1 × 2 grid

    # when
    expanded = expand_images(prompt, images, VISION, "messages")

    # then: the text with each image's expansion in its marker's place...
    first, second = (image_prompt(image_layout(i.height, i.width, VISION.settings), VISION.settings) for i in images)
    assert expanded.text == f"S<|im_start|>A{first}B<|im_end|>C{second}D"
    # ...every tag a control-token span, in order with the prompt's own, and nothing else...
    assert spans(expanded.text, expanded.special_ranges) == [
        "<|im_start|>",
        *TAG.findall(first),
        "<|im_end|>",
        *TAG.findall(second),
    ]
    assert "\n" in first and all("\n" not in span for span in spans(expanded.text, expanded.special_ranges))
    # ...and the ends still after the same characters
    assert expanded.text[: expanded.tool_ends[0]].endswith(f"{first}B")
    assert expanded.tool_call_ends == (len(expanded.text),)


def test_images_without_their_markers_are_refused_naming_the_messages():
    prompt = PromptText(f"a{IMAGE_MARKER}b", ())
    with pytest.raises(ApiError) as refused:
        expand_images(prompt, [image(40, 40), image(40, 40)], VISION, "input")
    assert refused.value.param == "input" and "2 images but 1" in refused.value.message


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"messages": [{"role": "user", "content": f"x{IMAGE_MARKER}"}]}, "messages[0].content"),
        ({"messages": [], "system": [{"type": "text", "text": IMAGE_MARKER}]}, "system[0].text"),
        ({"tools": [{"input_schema": {"properties": {IMAGE_MARKER: {}}}}]}, "tools[0].input_schema.properties"),
    ],
)
def test_the_marker_is_found_anywhere_in_a_body(body, field):
    with pytest.raises(ApiError) as refused:
        refuse_marker_text(body)
    assert refused.value.param == field


def test_a_body_without_the_marker_passes():
    refuse_marker_text({"messages": [{"role": "user", "content": "<｜User｜> <image> ｜image｜"}]})
