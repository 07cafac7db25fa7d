"""The encode worker's queue of images to encode, and the batches of tiles it cuts from them.

Images wait in arrival order; each batch takes the next tiles, whole images or parts of them, up to
the largest batch, so the tiles of several requests share one vision-tower forward and a large image
spans several. An image is preprocessed (resized and cut into tiles) only when its first tile is
batched, so a long queue holds decoded images, not their larger float tiles. An image whose content
hash is already queued joins that image instead of being encoded twice.
"""

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from workers.text.idefics3_images import ImageSettings, preprocess_image
from workers.worker.encoder.images import CheckedImage


@dataclass(eq=False)
class ImageJob:
    """One distinct image being encoded, and who waits for its embeddings: (an owner's key, such as
    a request and the image's index in it) pairs."""

    checked: CheckedImage
    waiters: list[Any]
    pixels: np.ndarray | None = None  # its tiles, once the first is batched
    next_tile: int = 0
    outputs: list[torch.Tensor] = field(default_factory=list)  # embeddings of its tiles so far, in order

    @property
    def num_tiles(self) -> int:
        return self.checked.layout.num_tiles


@dataclass(frozen=True, slots=True)
class TileBatch:
    pixels: np.ndarray  # [tiles, 3, side, side]
    parts: tuple[tuple[ImageJob, int], ...]  # (image, its tiles in this batch), in batch order


class TileQueue:
    def __init__(self, settings: ImageSettings) -> None:
        self.settings = settings
        self._images: deque[ImageJob] = deque()
        self._by_hash: dict[bytes, ImageJob] = {}  # queued images, to join rather than repeat

    def __bool__(self) -> bool:
        return bool(self._images)

    def add(self, checked: CheckedImage, waiter: Any) -> bool:
        """Queue the image for `waiter`; True when it joined the same image already queued."""
        queued = self._by_hash.get(checked.content_hash)
        if queued is not None:
            queued.waiters.append(waiter)
            return True
        job = ImageJob(checked, [waiter])
        self._images.append(job)
        self._by_hash[checked.content_hash] = job
        return False

    def next_batch(self, max_tiles: int) -> TileBatch:
        """The next tiles, at most `max_tiles`, from the images at the head of the queue."""
        pieces, parts = [], []
        taken = 0
        for job in self._images:
            if taken == max_tiles:
                break
            if job.pixels is None:
                job.pixels = preprocess_image(job.checked.image, self.settings)[0]
            count = min(job.num_tiles - job.next_tile, max_tiles - taken)
            pieces.append(job.pixels[job.next_tile : job.next_tile + count])
            parts.append((job, count))
            job.next_tile += count
            taken += count
        return TileBatch(np.concatenate(pieces), tuple(parts))

    def complete(self, batch: TileBatch, embeddings: torch.Tensor) -> list[ImageJob]:
        """Record the batch's embeddings ([tiles · tokens per tile, hidden]); the images now whole,
        taken off the queue with their embeddings in ImageJob.outputs[0]."""
        rows_per_tile = embeddings.shape[0] // batch.pixels.shape[0]
        done = []
        start = 0
        for job, count in batch.parts:
            job.outputs.append(embeddings[start : start + count * rows_per_tile])
            start += count * rows_per_tile
            if job.next_tile == job.num_tiles:
                job.outputs = [torch.cat(job.outputs)]
                job.pixels = None
                done.append(job)
        for job in done:
            self._images.remove(job)
            if self._by_hash.get(job.checked.content_hash) is job:
                del self._by_hash[job.checked.content_hash]
        return done
