"""The tile queue: batches of the next tiles across images and requests, a large image spanning
several batches, an image already queued joined rather than encoded twice."""

import numpy as np
import torch

from tests.workers.worker.encoder.conftest import SETTINGS, picture
from workers.text.idefics3_images import image_layout, preprocess_image
from workers.text.image_hash import image_content_hash
from workers.worker.encoder.batching import TileQueue
from workers.worker.encoder.images import CheckedImage

ROWS_PER_TILE = SETTINGS.image_seq_len


def checked(image) -> CheckedImage:
    layout = image_layout(image.height, image.width, SETTINGS)
    return CheckedImage(
        image=image,
        layout=layout,
        content_hash=image_content_hash(image),
        num_patches=layout.num_tiles * 16,
        num_tokens=layout.num_tiles * ROWS_PER_TILE,
    )


def fake_tower(pixels: np.ndarray) -> torch.Tensor:
    """Rows that say which tile they came from: each tile's mean pixel, repeated."""
    means = torch.from_numpy(pixels).mean(dim=(1, 2, 3))
    return means.repeat_interleave(ROWS_PER_TILE)[:, None]


def test_tiles_of_several_images_share_batches_and_a_large_image_spans_two():
    split, wide = picture(60, 44, seed=1), picture(200, 20, seed=2)
    assert [checked(image).layout.num_tiles for image in (split, wide)] == [5, 3]
    queue = TileQueue(SETTINGS)
    queue.add(checked(split), "split")
    queue.add(checked(wide), "wide")

    first = queue.next_batch(4)
    assert first.pixels.shape[0] == 4 and [count for _, count in first.parts] == [4]
    assert queue.complete(first, fake_tower(first.pixels)) == []

    second = queue.next_batch(4)
    assert [count for _, count in second.parts] == [1, 3]
    done = queue.complete(second, fake_tower(second.pixels))

    assert [job.waiters for job in done] == [["split"], ["wide"]]
    assert not queue
    for job, image in zip(done, (split, wide), strict=True):
        expected = fake_tower(preprocess_image(image, SETTINGS)[0])
        assert torch.equal(job.outputs[0], expected)
        assert job.pixels is None  # the tiles are not kept once encoded


def test_an_image_already_queued_is_joined_not_encoded_twice():
    image = picture(200, 20, seed=2)  # 3 tiles
    queue = TileQueue(SETTINGS)

    assert queue.add(checked(image), "first") is False
    assert queue.add(checked(image), "second") is True

    batch = queue.next_batch(8)
    assert batch.pixels.shape[0] == 3
    done = queue.complete(batch, fake_tower(batch.pixels))
    assert [job.waiters for job in done] == [["first", "second"]]
    assert queue.add(checked(image), "later") is False  # a finished image is queued anew
