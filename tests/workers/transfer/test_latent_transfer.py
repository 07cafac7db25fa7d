"""A latent (MLA) group's KV handed over as a full-attention group's is: as frames of host copies and
through a mapped pool (on the CPU a shareable cache's shared memory), it arrives equal in the
receiver's pages. A receiver whose cache is of the other layout (latent or full attention, of equal
size per token) refuses it, naming both layouts, and its cache stays untouched."""

import re

import msgspec
import pytest
import torch

from workers.engine.kv.kv_cache import KVCache
from workers.engine.kv.spec import KVCacheSpec, KVCacheSpecs, KVKind
from workers.engine.kv_handoff import KVHandoff, PagedLayers, check_handoff, check_layers, write_layers
from workers.protocol.errors import InvalidRequestError
from workers.protocol.sampling_params import SamplingParams
from workers.transfer.frames import (
    HandoffAssembler,
    KVTransferError,
    check_header,
    decode_lead,
    encode_handoff,
    encode_offer,
)
from workers.transfer.page_copy import PageCopy
from workers.transfer.pools import PoolError, PoolExport, PoolMaps

PAGE, PAGES, TOKENS = 16, 8, 40  # 3 pages, the last one part full
LATENT = KVCacheSpecs((KVCacheSpec(KVKind.LATENT, (0, 1, 2), torch.float32, PAGE, latent_width=576),))
# As many bytes per token as the latent: only the layouts tell them apart.
FULL = KVCacheSpecs((KVCacheSpec(KVKind.FULL, (0, 1, 2), torch.float32, PAGE, num_kv_heads=2, head_dim=144),))
SENT_PAGES, RECEIVING_PAGES = [5, 2, 7], [1, 3, 4]


def sender(specs: KVCacheSpecs) -> KVCache:
    cache = KVCache(specs, num_pages=PAGES, device=torch.device("cpu"), shareable=True)
    cache.pages.copy_(torch.randn(cache.pages.shape, generator=torch.Generator().manual_seed(0)))
    return cache


def receiver(specs: KVCacheSpecs) -> KVCache:
    return KVCache(specs, num_pages=PAGES, device=torch.device("cpu"))


def handoff_of(cache: KVCache) -> KVHandoff:
    layers = PagedLayers(cache, SENT_PAGES, TOKENS)
    return KVHandoff(
        request_id="r",
        prompt_token_ids=list(range(TOKENS)),
        output_token_ids=[7],
        params=SamplingParams(max_tokens=4),
        num_computed_tokens=TOKENS,
        num_cached_tokens=0,
        traffic_class="chat",
        cache_namespace="",
        kv_model_id="m",
        kv_dtype=layers.dtype,
        kv_layout=layers.layout,
        token_shape=layers.token_shape,
        num_layers=len(layers),
        layers=layers,
        pages=tuple(SENT_PAGES),
    )


def received_tokens(cache: KVCache, pages: list[int]) -> torch.Tensor:
    """[layers, planes, heads, TOKENS, width]: the request's KV as `cache` holds it in `pages`."""
    layers, planes, heads, _, _, width = cache.pages.shape
    held = cache.pages[:, :, :, pages].reshape(layers, planes, heads, len(pages) * PAGE, width)
    return held[:, :, :, :TOKENS]


def fits(handoff: KVHandoff, cache: KVCache) -> None:
    check_handoff(handoff, kv_model_id="m", vocab_size=128, max_tokens=8, kv_cache=cache)


def test_latent_kv_handed_over_as_frames_arrives_equal():
    sent, into = sender(LATENT), receiver(LATENT)
    handoff = handoff_of(sent)
    assert handoff.layer_shape == (1, 1, TOKENS, 576)

    assembler = HandoffAssembler(kv_layout=into.specs.layout)
    messages = [[bytes(frame) for frame in message] for message in encode_handoff(handoff, chunk_layers=2)]
    received = [assembler.feed(message) for message in messages][-1]
    fits(received, into)
    write_layers(into, RECEIVING_PAGES, check_layers(received), start=0)

    assert received.kv_layout == LATENT.layout and received.token_shape == (1, 1, 576)
    assert torch.equal(received_tokens(into, RECEIVING_PAGES), received_tokens(sent, SENT_PAGES))


def test_latent_kv_copied_from_a_mapped_pool_arrives_equal():
    sent, into = sender(LATENT), receiver(LATENT)
    export = PoolExport.of(sent, "prefill")
    (message,) = encode_offer(handoff_of(sent), export.offer(SENT_PAGES, hold_s=30))
    header = decode_lead(message)
    check_header(header, into.specs.layout)

    pool = PoolMaps().open(header.pool, into.specs.layout)
    PageCopy.start(pool, header.pool.pages, into.pages, RECEIVING_PAGES, None)

    assert header.pool.kv_layout == LATENT.layout and tuple(pool.shape) == (3, 1, 1, PAGES, PAGE, 576)
    assert torch.equal(received_tokens(into, RECEIVING_PAGES), received_tokens(sent, SENT_PAGES))


def refusal(theirs: KVCacheSpecs, ours: KVCacheSpecs) -> str:
    return re.escape(f"laid out as {theirs.layout!r}; this worker's cache holds {ours.layout!r}")


@pytest.mark.parametrize("theirs, ours", [(LATENT, FULL), (FULL, LATENT)])
def test_frames_of_the_other_layout_are_refused_at_their_header_naming_both(theirs, ours):
    sent, into = sender(theirs), receiver(ours)
    assert theirs.bytes_per_token == ours.bytes_per_token
    handoff = handoff_of(sent)
    header, *layers = next(iter(encode_handoff(handoff, chunk_layers=1)))
    assembler = HandoffAssembler(kv_layout=into.specs.layout)

    with pytest.raises(KVTransferError, match=refusal(theirs, ours)):
        assembler.feed([bytes(header), *(bytes(layer) for layer in layers)])
    with pytest.raises(InvalidRequestError, match=re.escape(f"{theirs.layout!r}; this engine's cache holds")):
        fits(handoff.materialized(), into)

    assert not assembler.partial and not into.pages.any()


@pytest.mark.parametrize("theirs, ours", [(LATENT, FULL), (FULL, LATENT)])
def test_a_pool_of_the_other_layout_is_refused_naming_both_and_never_mapped(theirs, ours):
    sent, into = sender(theirs), receiver(ours)
    offer = PoolExport.of(sent, "prefill").offer(SENT_PAGES, hold_s=30)
    (message,) = encode_offer(handoff_of(sent), offer)
    maps = PoolMaps()

    with pytest.raises(KVTransferError, match=refusal(theirs, ours)):
        check_header(decode_lead(message), into.specs.layout)
    with pytest.raises(PoolError, match=re.escape(f"laid out as {theirs.layout!r}; this worker's cache holds")):
        maps.open(offer, into.specs.layout)

    assert not maps and not into.pages.any()


def test_an_offer_whose_pool_and_kv_differ_in_layout_is_refused():
    sent = sender(LATENT)
    offer = PoolExport.of(sent, "prefill").offer(SENT_PAGES, hold_s=30)
    (message,) = encode_offer(handoff_of(sent), msgspec.structs.replace(offer, kv_layout=FULL.layout))

    with pytest.raises(KVTransferError, match=re.escape(f"offers a pool laid out as {FULL.layout!r}, its KV as")):
        check_header(decode_lead(message))
