import pytest

from workers.engine.kv.block_manager import BlockManager
from workers.engine.request import Request
from workers.protocol.sampling_params import SamplingParams


def make_request(tokens: list[int], rid: str = "r", extra: bytes = b"m") -> Request:
    return Request(request_id=rid, prompt_token_ids=tokens, params=SamplingParams(), max_tokens=8, hash_extra=extra)


def compute(manager: BlockManager, request: Request, count: int) -> None:
    """What the scheduler and engine do around a step: allocate, then mark computed and key pages."""
    assert manager.allocate(request, count)
    request.num_computed_tokens += count
    manager.cache_full_pages(request)


def test_allocation_hands_out_pages_in_order_and_never_the_null_page():
    manager = BlockManager(num_pages=6, page_size=4)
    request = make_request(list(range(10)))
    assert manager.allocate(request, 10)
    assert request.pages == [1, 2, 3]
    assert manager.num_free_pages == 2
    assert [manager.ref_counts[p] for p in (1, 2, 3)] == [1, 1, 1]


def test_allocation_is_all_or_nothing():
    manager = BlockManager(num_pages=3, page_size=4)
    request = make_request(list(range(12)))
    assert not manager.allocate(request, 12)  # needs 3 pages, 2 usable
    assert request.pages == [] and manager.num_free_pages == 2


def test_prefix_hit_shares_pages_and_leaves_one_token_to_compute():
    manager = BlockManager(num_pages=10, page_size=4)
    first = make_request(list(range(12)), "a")
    compute(manager, first, 12)
    second = make_request(list(range(12)), "b")
    pages, keys = manager.find_cached_prefix(second)
    # 12 tokens = 3 full pages, but the last token must be recomputed: only 2 pages hit.
    assert pages == first.pages[:2]
    assert keys == first.page_hashes[:2]
    assert manager.allocate(second, 4, (pages, keys))
    assert second.pages[:2] == first.pages[:2]
    assert manager.ref_counts[first.pages[0]] == 2
    assert second.pages[2] not in first.pages


def test_different_namespace_does_not_hit():
    manager = BlockManager(num_pages=10, page_size=4)
    compute(manager, make_request(list(range(12)), "a", extra=b"tenant-a"), 12)
    assert manager.find_cached_prefix(make_request(list(range(12)), "b", extra=b"tenant-b")) == ([], [])


def test_freed_pages_keep_their_keys_and_can_be_hit_again():
    manager = BlockManager(num_pages=10, page_size=4)
    first = make_request(list(range(9)), "a")
    compute(manager, first, 9)
    held = list(first.pages)
    manager.free(first)
    assert manager.num_free_pages == 9
    pages, _ = manager.find_cached_prefix(make_request(list(range(9)), "b"))
    assert pages == held[:2]


def test_eviction_order_reuses_unkeyed_pages_first_then_chain_tails():
    manager = BlockManager(num_pages=6, page_size=4)
    first = make_request(list(range(9)), "a")  # pages 1, 2 full (keyed), page 3 partial
    compute(manager, first, 9)
    manager.free(first)
    # Free list: untouched 4, 5, then the keyless partial page 3 in front, then tail-first 2, 1.
    assert list(manager.free_pages) == [3, 4, 5, 2, 1]
    taker = make_request(list(range(100, 120)), "c")
    assert manager.allocate(taker, 16)
    assert taker.pages == [3, 4, 5, 2]
    # Page 2's key is gone, page 1's prefix is still cached.
    pages, _ = manager.find_cached_prefix(make_request(list(range(9)), "d"))
    assert pages == [1]


def test_collision_guard_compares_tokens():
    manager = BlockManager(num_pages=6, page_size=4)
    first = make_request(list(range(8)), "a")
    compute(manager, first, 8)
    page = first.pages[0]
    manager.page_tokens[page] = (9, 9, 9, 9)  # pretend the key collided with other tokens
    assert manager.find_cached_prefix(make_request(list(range(8)), "b")) == ([], [])


def test_prefix_caching_can_be_disabled():
    manager = BlockManager(num_pages=10, page_size=4, enable_prefix_caching=False)
    compute(manager, make_request(list(range(12)), "a"), 12)
    assert manager.find_cached_prefix(make_request(list(range(12)), "b")) == ([], [])


def test_lookahead_slots_are_covered_by_pages_past_the_new_tokens():
    manager = BlockManager(num_pages=6, page_size=4)
    request = make_request(list(range(7)))
    assert manager.allocate(request, 7, lookahead=2)  # 9 slots: 3 pages
    assert request.pages == [1, 2, 3]
    request.num_computed_tokens = 7
    assert manager.allocate(request, 1, lookahead=4)  # 12 slots: still 3 pages
    assert request.pages == [1, 2, 3] and not manager.allocate(request, 1, lookahead=13)
    assert request.pages == [1, 2, 3]


def test_pages_are_allocated_per_group_and_a_window_gives_back_what_it_no_longer_reads():
    # Two KV groups: full attention (the request's pages) and a sliding window of 6 tokens.
    manager = BlockManager(num_pages=8, page_size=4, windows=(None, 6))
    request = make_request(list(range(10)))
    assert manager.allocate(request, 10)
    assert request.pages == [1, 2, 3] and manager.pages_of(request, 1) == [1, 2, 3]
    request.num_computed_tokens = 10
    # The next query (token 10) reads tokens 5..10: page 0 (tokens 0-3) is out of the window.
    assert manager.allocate(request, 4)
    # The released page, keyless, is the first one reused.
    assert request.pages == [1, 2, 3, 4] and manager.pages_of(request, 1) == [0, 2, 3, 1]
    assert list(manager.pools[1].free_pages) == [4, 5, 6, 7]
    assert manager.num_free_pages == 3  # the full group's

    manager.free(request)
    assert manager.num_free_pages == 7 and manager.pages_of(request, 1) == []


def test_allocation_is_all_or_nothing_across_groups():
    manager = BlockManager(num_pages=8, page_size=4, windows=(None, 64))
    holder = make_request(list(range(20)), "holder")
    assert manager.allocate(holder, 20)  # 5 pages in each group
    manager.pools[1].take(), manager.pools[1].take()  # the window group runs short first
    request = make_request(list(range(4)), "r")
    assert not manager.allocate(request, 4)
    assert request.pages == [] and manager.pages_of(request, 1) == [] and len(manager.free_pages) == 2


def test_the_first_group_keeps_every_page():
    with pytest.raises(ValueError, match="first KV group"):
        BlockManager(num_pages=8, page_size=4, windows=(6, None))


def test_a_long_decode_holds_at_most_the_window_s_pages_and_frees_the_rest():
    # A window of 10 tokens over pages of 4: a step's query reads 10 tokens, on ceil(10 / 4) + 1 = 4
    # pages at most.
    manager = BlockManager(num_pages=64, page_size=4, windows=(None, 10))
    request = make_request(list(range(5)))
    compute(manager, request, 5)
    held = []
    for _ in range(60):
        assert manager.allocate(request, 1)
        held.append(sum(page != 0 for page in manager.pages_of(request, 1)))
        request.num_computed_tokens += 1

    assert max(held) == 4 and min(held[5:]) == 3  # from position 10 on, 10 tokens span 3 pages or 4
    assert len(request.pages) == 17  # 65 tokens: the full group keeps every page
    assert manager.pools[1].num_free == 63 - held[-1] and manager.pools[0].num_free == 63 - 17


def test_a_hybrid_prefix_hit_shares_the_window_pages_before_it():
    manager = BlockManager(num_pages=32, page_size=4, windows=(None, 6))
    tokens = list(range(21))
    first = make_request(tokens, "first")
    compute(manager, first, 21)
    full_pages, window_pages = list(first.pages), manager.pages_of(first, 1)
    manager.free(first)

    second = make_request(tokens, "second")
    cached = manager.find_cached_prefix(second)
    assert manager.allocate(second, 1, cached)

    # A hit of 5 pages (20 tokens): the query at 20 reads 15..20, so the window needs page 3 (12-15)
    # and page 4 (16-19), both still cached; pages 0-2 are behind it.
    assert second.pages[:5] == full_pages[:5]
    assert manager.pages_of(second, 1)[:5] == [0, 0, 0, window_pages[3], window_pages[4]]
    assert [manager.pools[1].ref_counts[page] for page in window_pages[3:5]] == [1, 1]


def test_a_hybrid_hit_backs_off_to_where_its_window_pages_are_still_cached():
    manager = BlockManager(num_pages=32, page_size=4, windows=(None, 6))
    tokens = list(range(21))
    first = make_request(tokens, "first")
    compute(manager, first, 21)
    window_pages = list(manager.pages_of(first, 1))
    manager.free(first)
    window = manager.pools[1]
    # Free window pages are reused keyless first, then keyed ones oldest first; freed tail first, the
    # window's last full page (4) goes before the earlier ones.
    while window.page_keys[window_pages[4]] is not None:
        window.take()

    # The query at 16 reads 11..16: window pages 2 and 3, still cached.
    assert len(manager.find_cached_prefix(make_request(tokens, "second"))[0]) == 4
    window.take()  # page 3
    # The query at 12 reads 7..12: pages 1 and 2.
    assert len(manager.find_cached_prefix(make_request(tokens, "third"))[0]) == 3
