"""Copies a request's KV pages out of a mapped pool (workers.transfer.pools) into this engine's own pages.

On a GPU the copy runs on a side stream, so the engine's steps go on while it runs; `done()` says
when the KV is there (the request joins the batch then, never before). The side stream first waits
for the work already queued on the engine's stream: the pages it writes were free, but a step still
in flight may belong to a request that held them until that step. Layers are copied a few at a time,
so the temporary holding one chunk's pages stays under COPY_CHUNK_BYTES. On the CPU the copy is done
when start returns.
"""

import torch

COPY_CHUNK_BYTES = 256 << 20


class PageCopyError(Exception):
    """Pages that do not fit one of the two pools: nothing was copied."""


class PageCopy:
    def __init__(self, event: torch.cuda.Event | None, num_bytes: int) -> None:
        self._event = event
        self.num_bytes = num_bytes

    def done(self) -> bool:
        return self._event is None or self._event.query()

    @classmethod
    def start(
        cls,
        source: torch.Tensor,
        source_pages: list[int],
        destination: torch.Tensor,
        destination_pages: list[int],
        stream: "torch.cuda.Stream | None",
    ) -> "PageCopy":
        """Copy `source_pages` of `source` into `destination_pages` of `destination`, both pools
        [layers, planes, heads, pages, page_size, width] of one layout and dtype; `stream` is the side
        stream on a GPU, None on the CPU."""
        if source.shape[:3] + source.shape[4:] != destination.shape[:3] + destination.shape[4:]:
            raise PageCopyError(f"pool {tuple(source.shape)} and pages {tuple(destination.shape)} differ in layout")
        if source.dtype != destination.dtype:
            raise PageCopyError(f"pool of {source.dtype} and pages of {destination.dtype}")
        if len(source_pages) != len(destination_pages):
            raise PageCopyError(f"{len(source_pages)} pages offered for {len(destination_pages)}")
        for pages, pool in ((source_pages, source), (destination_pages, destination)):
            if any(not 0 <= page < pool.shape[3] for page in pages):
                raise PageCopyError(f"page ids outside [0, {pool.shape[3]})")
        per_layer = source[0].numel() // source.shape[3] * len(source_pages) * source.element_size()
        num_bytes = per_layer * source.shape[0]
        if not source_pages:
            return cls(None, 0)
        layers_per_chunk = max(1, COPY_CHUNK_BYTES // max(per_layer, 1))
        if stream is None:
            _copy(source, source_pages, destination, destination_pages, layers_per_chunk)
            return cls(None, num_bytes)
        stream.wait_stream(torch.cuda.current_stream(destination.device))
        with torch.cuda.stream(stream):
            _copy(source, source_pages, destination, destination_pages, layers_per_chunk)
            event = torch.cuda.Event()
            event.record(stream)
        return cls(event, num_bytes)


@torch.inference_mode()
def _copy(
    source: torch.Tensor, source_pages: list[int], destination: torch.Tensor, destination_pages: list[int], chunk: int
) -> None:
    taken = torch.tensor(source_pages, device=source.device)
    placed = torch.tensor(destination_pages, device=destination.device)
    for first in range(0, source.shape[0], chunk):
        pages = source[first : first + chunk].index_select(3, taken)
        destination[first : first + chunk].index_copy_(3, placed, pages.to(destination.device, non_blocking=True))
