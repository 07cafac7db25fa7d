"""Idefics3 / SmolVLM image preprocessing and the image-token layout, as HF's Idefics3Processor
(its Pillow backend) computes them: torch-free, so that the gateway can count an image's tokens and
expand a prompt's placeholders, and an encoder can get the pixel values, with no engine loaded.

An image is converted to RGB (transparency composited on white), resized so its longest edge is
`longest_edge`, then, with splitting, resized up to whole tiles of `tile_side` and cut into a
rows × cols grid of tiles followed by the whole image shrunk to one tile (the global image); an image
that fits one tile is that tile alone. Pixels are rescaled and normalized per channel. In the prompt,
each "<image>" becomes, per grid tile, "<fake_token_around_image><row_r_col_c>" and `image_seq_len`
"<image>" tokens (a newline after each row), then "\\n<fake_token_around_image><global-img>", the
global tile's tokens and a closing "<fake_token_around_image>".
"""

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from workers.text.image_hash import rgb_pixels

IMAGE_TOKEN = "<image>"
FAKE_TOKEN_AROUND_IMAGE = "<fake_token_around_image>"
GLOBAL_IMAGE_TOKEN = "<global-img>"
# HF caps a resized image's longest edge at 4k whatever the settings say.
MAX_IMAGE_SIDE = 4096


@dataclass(frozen=True, slots=True)
class ImageSettings:
    """A model's preprocessor_config.json (and the processor's image_seq_len), as read here."""

    longest_edge: int  # size.longest_edge: the whole image's longest edge after the first resize
    tile_side: int  # max_image_size.longest_edge: a tile's side, the vision tower's image_size
    image_seq_len: int  # image tokens per tile
    split_images: bool = True
    resample: int = Image.Resampling.LANCZOS
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    @classmethod
    def from_hf(cls, preprocessor: dict[str, Any], image_seq_len: int) -> "ImageSettings":
        """Settings from a preprocessor_config.json dict; steps it turns off are refused, not skipped."""
        for step in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
            if preprocessor.get(step, True) is not True:
                raise ValueError(f"preprocessor {step}={preprocessor[step]!r} is not supported")
        try:
            return cls(
                longest_edge=int(preprocessor.get("size", {}).get("longest_edge", 4 * 364)),
                tile_side=int(preprocessor.get("max_image_size", {}).get("longest_edge", 364)),
                image_seq_len=int(image_seq_len),
                split_images=bool(preprocessor.get("do_image_splitting", True)),
                resample=int(preprocessor.get("resample", Image.Resampling.LANCZOS)),
                rescale_factor=float(preprocessor.get("rescale_factor", 1 / 255)),
                image_mean=tuple(float(v) for v in preprocessor.get("image_mean", (0.5, 0.5, 0.5))),
                image_std=tuple(float(v) for v in preprocessor.get("image_std", (0.5, 0.5, 0.5))),
            )
        except (AttributeError, TypeError, ValueError) as malformed:
            raise ValueError(f"malformed preprocessor config: {malformed}") from None


@dataclass(frozen=True, slots=True)
class ImageLayout:
    """Where an image's tiles go: the sizes it is resized to and its grid (0 × 0: one tile, no grid)."""

    resized: tuple[int, int]  # (height, width) after the longest-edge resize
    tiled: tuple[int, int]  # (height, width) the tiles are cut from; resized without splitting
    rows: int
    cols: int

    @property
    def num_tiles(self) -> int:
        """Tiles given to the vision encoder: the grid and the global image, or the one tile."""
        return self.rows * self.cols + 1 if self.rows else 1


def image_layout(height: int, width: int, settings: ImageSettings) -> ImageLayout:
    """The layout of an image of this size: all the gateway needs to count its tokens."""
    if height < 1 or width < 1:
        raise ValueError(f"an image must have pixels, got {width}x{height}")
    resized = _cap_longest_edge(*_longest_edge_to(height, width, settings.longest_edge))
    if not settings.split_images:
        return ImageLayout(resized=resized, tiled=resized, rows=0, cols=0)
    tiled = _whole_tiles(*resized, settings.tile_side)
    tile = settings.tile_side
    if tiled[0] > tile or tiled[1] > tile:
        return ImageLayout(resized=resized, tiled=tiled, rows=tiled[0] // tile, cols=tiled[1] // tile)
    return ImageLayout(resized=resized, tiled=tiled, rows=0, cols=0)


def image_prompt(layout: ImageLayout, settings: ImageSettings) -> str:
    """The text one "<image>" of a prompt becomes."""
    tile_tokens = IMAGE_TOKEN * settings.image_seq_len
    global_tile = f"{FAKE_TOKEN_AROUND_IMAGE}{GLOBAL_IMAGE_TOKEN}{tile_tokens}{FAKE_TOKEN_AROUND_IMAGE}"
    if not layout.rows:
        return global_tile
    rows = (
        "".join(f"{FAKE_TOKEN_AROUND_IMAGE}<row_{r + 1}_col_{c + 1}>{tile_tokens}" for c in range(layout.cols)) + "\n"
        for r in range(layout.rows)
    )
    return "".join(rows) + "\n" + global_tile


def image_tag_tokens(settings: ImageSettings) -> tuple[str, ...]:
    """Every tag image_prompt writes for an image of any size with these settings (each one special
    token of the model's vocabulary): the fake token, the image token, the global-image tag and the
    row/column tags of the largest grid."""
    most = math.ceil(min(settings.longest_edge, MAX_IMAGE_SIDE) / settings.tile_side) if settings.split_images else 0
    grid = tuple(f"<row_{r}_col_{c}>" for r in range(1, most + 1) for c in range(1, most + 1))
    return (FAKE_TOKEN_AROUND_IMAGE, IMAGE_TOKEN, GLOBAL_IMAGE_TOKEN, *grid)


def num_image_tokens(layout: ImageLayout, settings: ImageSettings, *, double_newline_tokens: int) -> int:
    """How many tokens image_prompt(layout) encodes to, without encoding it: the markers are special
    tokens, so each newline run between them encodes alone, a lone "\n" as one token and the "\n\n"
    before the global tile as `double_newline_tokens` (1 where the vocabulary merges it, else 2)."""
    global_tile = 3 + settings.image_seq_len  # two fake tokens, the global-image tag, the tokens
    if not layout.rows:
        return global_tile
    grid = layout.rows * layout.cols * (2 + settings.image_seq_len)  # a fake token and a row/col tag each
    return grid + (layout.rows - 1) + double_newline_tokens + global_tile


def expand_image_placeholders(prompt: str, layouts: list[ImageLayout], settings: ImageSettings) -> str:
    """The prompt with its k-th "<image>" replaced by image k's expansion."""
    pieces = prompt.split(IMAGE_TOKEN)
    if len(pieces) - 1 != len(layouts):
        raise ValueError(f"the prompt has {len(pieces) - 1} {IMAGE_TOKEN} placeholders for {len(layouts)} images")
    expanded = [pieces[0]]
    for layout, text in zip(layouts, pieces[1:], strict=True):
        expanded += [image_prompt(layout, settings), text]
    return "".join(expanded)


def preprocess_image(image: Image.Image, settings: ImageSettings) -> tuple[np.ndarray, ImageLayout]:
    """The image's tiles as float32 pixel values [tiles, 3, tile_side, tile_side] (the global image
    last), and its layout."""
    layout = image_layout(image.height, image.width, settings)
    rgb = _resize(rgb_pixels(image), layout.resized, settings.resample)
    if not settings.split_images:
        tiles = [_resize(rgb, (settings.tile_side, settings.tile_side), settings.resample)]
    else:
        tiled = _resize(rgb, layout.tiled, settings.resample)
        side = settings.tile_side
        tiles = [
            tiled[r * side : (r + 1) * side, c * side : (c + 1) * side]
            for r in range(layout.rows)
            for c in range(layout.cols)
        ]
        tiles.append(_resize(tiled, (side, side), settings.resample) if layout.rows else tiled)
    pixels = np.stack(tiles).transpose(0, 3, 1, 2)
    # As HF: rescaled in float64 and stored as float32, normalized in float32.
    scaled = (pixels.astype(np.float64) * settings.rescale_factor).astype(np.float32)
    mean = np.array(settings.image_mean, dtype=np.float32)[:, None, None]
    std = np.array(settings.image_std, dtype=np.float32)[:, None, None]
    return (scaled - mean) / std, layout


def _resize(pixels: np.ndarray, size: tuple[int, int], resample: int) -> np.ndarray:
    height, width = size
    return np.array(Image.fromarray(pixels).resize((width, height), resample=resample))


def _longest_edge_to(height: int, width: int, longest: int) -> tuple[int, int]:
    """The longest edge scaled to `longest`, the other by the aspect ratio, made even (HF's rule)."""
    aspect = width / height
    if width >= height:
        width, height = longest, int(longest / aspect)
        height += height % 2
    else:
        height, width = longest, int(longest * aspect)
        width += width % 2
    return max(height, 1), max(width, 1)


def _cap_longest_edge(height: int, width: int) -> tuple[int, int]:
    aspect = width / height
    if width >= height and width > MAX_IMAGE_SIDE:
        width, height = MAX_IMAGE_SIDE, int(MAX_IMAGE_SIDE / aspect)
    elif height > width and height > MAX_IMAGE_SIDE:
        height, width = MAX_IMAGE_SIDE, int(MAX_IMAGE_SIDE * aspect)
    return max(height, 1), max(width, 1)


def _whole_tiles(height: int, width: int, tile: int) -> tuple[int, int]:
    """The size in whole tiles that the image is resized to before it is cut: the longest edge rounded
    up to tiles, the other edge scaled from it by the aspect ratio and rounded up to tiles."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width
