"""Where the image inputs of a Chat Completions, Responses or Messages body are, in prompt order.

deepseek-recipe reads the same parts into each message's `image_sources` (and puts the image
placeholders in the prompt), but the paths it records differ per protocol and name no field inside a
part. This module walks the body itself, so that every refusal names the field exactly, such as
`messages[0].content[1].image_url`:

    Chat Completions   {"type": "image_url", "image_url": {"url": ..., "detail": ...}}
    Responses          {"type": "input_image", "image_url": ..., "detail": ...}
    Messages           {"type": "image", "source": {"type": "base64", "media_type": ..., "data": ...}}
                       {"type": "image", "source": {"type": "url", "url": ...}}

also inside an Anthropic `tool_result` block's content. Data URLs and base64 blocks become DataImage
(their bytes are decoded later, against the bytes limit); http(s) URLs become UrlImage.
"""

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

from recipe.errors import ApiError, invalid_request
from recipe.limits import Path, field_name

DETAILS = frozenset({"auto", "low", "high"})
_MESSAGES_FIELD = {"chat.completions": "messages", "responses": "input", "messages": "messages"}
_PART_TYPES = {"chat.completions": "image_url", "responses": "input_image", "messages": "image"}


@dataclass(frozen=True, slots=True)
class DataImage:
    media_type: str  # as the client declared it: "image/png"
    payload: str  # base64 (or, in a data URL without ";base64", percent-encoded) text
    is_base64: bool


@dataclass(frozen=True, slots=True)
class UrlImage:
    url: str  # http or https


@dataclass(frozen=True, slots=True)
class ImagePart:
    field: str  # the field refusals name, e.g. `messages[0].content[1].image_url`
    source: DataImage | UrlImage
    detail: Literal["auto", "low", "high"]


def image_parts(protocol: str, body: Mapping) -> list[ImagePart]:
    """Every image part of the body, in the order its placeholder appears in the prompt."""
    if protocol not in _PART_TYPES:
        return []
    return [_read_part(protocol, path, part) for path, part in _image_dicts(protocol, body)]


def _image_dicts(protocol: str, body: Mapping) -> Iterator[tuple[Path, Mapping]]:
    field = _MESSAGES_FIELD[protocol]
    messages = body.get(field)
    if not isinstance(messages, list):
        return
    for index, message in enumerate(messages):
        if isinstance(message, Mapping) and isinstance(message.get("content"), list):
            yield from _parts_in((field, index, "content"), message["content"], _PART_TYPES[protocol])


def _parts_in(where: Path, content: list, part_type: str) -> Iterator[tuple[Path, Mapping]]:
    for index, part in enumerate(content):
        if not isinstance(part, Mapping):
            continue
        if part.get("type") == part_type:
            yield (*where, index), part
        elif part.get("type") == "tool_result" and isinstance(part.get("content"), list):
            yield from _parts_in((*where, index, "content"), part["content"], part_type)


def _read_part(protocol: str, path: Path, part: Mapping) -> ImagePart:
    if protocol == "messages":
        return _anthropic_part(path, part)
    url_field = (*path, "image_url")
    url, detail = part.get("image_url"), part.get("detail")
    if protocol == "chat.completions":
        if not isinstance(url, Mapping):
            raise _refusal(url_field, "must be an object with a `url`")
        detail = url.get("detail")
        url_field, url = (*url_field, "url"), url.get("url")
    if not isinstance(url, str):
        missing = "file_id images are not supported; send `image_url`" if part.get("file_id") else "is required"
        raise _refusal(url_field, f"must be a string: {missing}" if url is not None else missing)
    return ImagePart(field_name(url_field), _url_source(url_field, url), _detail((*path, "detail"), detail))


def _anthropic_part(path: Path, part: Mapping) -> ImagePart:
    source_field = (*path, "source")
    source = part.get("source")
    if not isinstance(source, Mapping):
        raise _refusal(source_field, "is required and must be an object")
    kind = source.get("type")
    if kind == "url":
        url = source.get("url")
        if not isinstance(url, str):
            raise _refusal((*source_field, "url"), "is required and must be a string")
        return ImagePart(field_name(source_field), _url_source((*source_field, "url"), url), "auto")
    if kind == "base64":
        media_type, data = source.get("media_type"), source.get("data")
        if not isinstance(media_type, str) or not media_type.lower().startswith("image/"):
            raise _refusal((*source_field, "media_type"), "must be an image type, such as image/png")
        if not isinstance(data, str):
            raise _refusal((*source_field, "data"), "is required and must be base64 text")
        return ImagePart(field_name(source_field), DataImage(media_type.lower(), data, is_base64=True), "auto")
    raise _refusal((*source_field, "type"), "must be `base64` or `url`")


def _url_source(where: Path, url: str) -> DataImage | UrlImage:
    scheme = url.partition(":")[0].lower()
    if scheme in ("http", "https"):
        return UrlImage(url)
    if scheme != "data":
        raise _refusal(where, "must be an http(s) URL or a data URL")
    header, comma, payload = url[len("data:") :].partition(",")
    media_type, *parameters = header.split(";")
    if not comma or not media_type.lower().startswith("image/"):
        raise _refusal(where, "must be a data URL of an image type, such as data:image/png;base64,...")
    return DataImage(media_type.lower(), payload, is_base64="base64" in (p.lower() for p in parameters))


def _detail(where: Path, detail: object) -> Literal["auto", "low", "high"]:
    if detail is None:
        return "auto"
    if detail not in DETAILS:
        raise _refusal(where, "must be `auto`, `low` or `high`")
    return detail


def _refusal(where: Path, problem: str) -> ApiError:
    name = field_name(where)
    return invalid_request(f"`{name}` {problem}", name)
