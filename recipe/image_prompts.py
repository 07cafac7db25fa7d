"""A request's images in its prompt, for a vision-language model (recipe.served_model.ServedModel.vision).

deepseek-recipe's conversion puts IMAGE_MARKER in a message's content where each image part was, in
the order recipe.images reads the parts. Here each marker of the rendered prompt becomes its image's
placeholder expansion (workers.text.idefics3_images.image_prompt, for the image's size): each tag in
it (`<fake_token_around_image>`, `<row_1_col_1>`, `<image>`...) a control-token span, each newline
plain text, so the prompt's token ids are the ones the offline engine builds for the same prompt and
images. The images go to the encoder as EncodeImages, in prompt order.

User text never makes an image: a request whose text spells IMAGE_MARKER anywhere (a message, a
system prompt, a tool definition) is refused naming that field, since a marker from text could not be
told from an image's; the tags themselves are special tokens (checked when the model is loaded),
which text, encoded with special tokens off, only ever spells as plain text.
"""

import bisect
import functools
import re
from collections.abc import Iterator, Mapping, Sequence

from recipe.chatml import PromptText
from recipe.errors import invalid_request
from recipe.images.resolve import RequestImage
from recipe.limits import Path, field_name
from workers.protocol.encode import EncodeImage
from workers.text.idefics3_images import image_prompt, image_tag_tokens
from workers.text.vision_prompt import VisionPrompt

IMAGE_MARKER = "<｜image｜>"


def expand_images(
    prompt: PromptText, images: Sequence[RequestImage], vision: VisionPrompt, messages_field: str
) -> PromptText:
    """`prompt` with its k-th IMAGE_MARKER replaced by image k's expansion; its control-token spans and
    the tool and tool-call ends move with the text."""
    markers = [match.start() for match in re.finditer(re.escape(IMAGE_MARKER), prompt.text)]
    if len(markers) != len(images):
        raise invalid_request(
            f"`{messages_field}`: the request has {len(images)} images but {len(markers)} of them have a place "
            "in the prompt (images go in user messages and tool results)",
            messages_field,
        )
    tags = _tag_pattern(vision)
    pieces, spans, marker_ends, growth = [], [], [], []
    position, grown = 0, 0
    for start, image in zip(markers, images, strict=True):
        expansion = image_prompt(vision.layout(image.height, image.width), vision.settings)
        pieces += [prompt.text[position:start], expansion]
        at = start + grown
        spans += [(at + tag.start(), at + tag.end()) for tag in tags.finditer(expansion)]
        position = start + len(IMAGE_MARKER)
        grown += len(expansion) - len(IMAGE_MARKER)
        marker_ends.append(position)
        growth.append(grown)
    pieces.append(prompt.text[position:])

    def moved(old: int) -> int:
        before = bisect.bisect_right(marker_ends, old)
        return old + (growth[before - 1] if before else 0)

    kept = [(moved(start), moved(end)) for start, end in prompt.special_ranges]
    return PromptText(
        "".join(pieces),
        tuple(sorted(kept + spans)),
        tuple(moved(end) for end in prompt.tool_ends),
        tuple(moved(end) for end in prompt.tool_call_ends),
    )


def encode_images(images: Sequence[RequestImage], vision: VisionPrompt) -> tuple[EncodeImage, ...]:
    """What the encoder gets for each image, in prompt order."""
    encoded = []
    for image in images:
        layout = vision.layout(image.height, image.width)
        encoded.append(
            EncodeImage(
                content_hash=image.content_hash,
                data=image.data,
                num_patches=vision.num_patches(layout),
                num_tokens=vision.num_tokens(layout),
            )
        )
    return tuple(encoded)


def refuse_marker_text(body: Mapping) -> None:
    """Refuses a body with IMAGE_MARKER in any of its strings (or keys), naming the first such field."""
    path = next(_paths_spelling(body, IMAGE_MARKER, ()), None)
    if path is not None:
        field = field_name(path)
        raise invalid_request(
            f"`{field}` contains `{IMAGE_MARKER}`, which marks an image in this model's prompts; "
            "send images as image parts",
            field,
        )


def _paths_spelling(value: object, text: str, path: Path) -> Iterator[Path]:
    if isinstance(value, str):
        if text in value:
            yield path
    elif isinstance(value, Mapping):
        for key, item in value.items():
            if isinstance(key, str) and text in key:
                yield path
            yield from _paths_spelling(item, text, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _paths_spelling(item, text, (*path, index))


@functools.cache
def _tag_pattern(vision: VisionPrompt) -> re.Pattern[str]:
    tags = sorted(image_tag_tokens(vision.settings), key=len, reverse=True)
    return re.compile("|".join(re.escape(tag) for tag in tags))
