"""Fetching SWA state from its holder over real ZMQ sockets (tcp loopback): hits, blocks evicted
meanwhile, holders gone or silent, replies of another layout or forged, and requests the server cannot
read, which it refuses and goes on."""

import threading
from collections.abc import Callable, Iterator

import msgspec
import pytest
import torch
import zmq

from workers.curve import generate_key
from workers.engine.kv.spec import KVCacheSpec, KVKind
from workers.engine.kv.swa_state import SwaStateCache
from workers.kvstore.block_hash import hash_chain
from workers.protocol.messages import MAX_SWA_STATE_KEYS, SwaStateReply, SwaStateRequest
from workers.transfer.frames import tensor_frame
from workers.transfer.swa_fetch import SwaStateFetcher, SwaStateServer

BLOCK = 4
KEYS = hash_chain(list(range(40)), BLOCK, b"model")
LOOPBACK = "tcp://127.0.0.1:*"
SHORT_S = 0.3  # the deadline where a test waits it out


def swa_spec(window: int = 9, dtype: torch.dtype = torch.float32) -> KVCacheSpec:
    return KVCacheSpec(
        kind=KVKind.SLIDING_WINDOW, layers=(1, 3), dtype=dtype, page_size=4, num_kv_heads=2, head_dim=8, window=window
    )


def run(seed: int, spec: KVCacheSpec, block: int = BLOCK) -> torch.Tensor:
    return torch.randn(spec.run_shape(block), generator=torch.Generator().manual_seed(seed)).to(spec.dtype)


@pytest.fixture
def context() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def serve(context: zmq.Context) -> Iterator[Callable[..., SwaStateServer]]:
    """Start SwaStateServers on threads; stopped afterwards."""
    running = []

    def start(cache: SwaStateCache, **kwargs) -> SwaStateServer:
        server = SwaStateServer(cache, LOOPBACK, context, **kwargs)
        stop = threading.Event()
        thread = threading.Thread(target=server.serve, args=(stop,))
        thread.start()
        running.append((stop, thread))
        return server

    yield start
    for stop, thread in running:
        stop.set()
        thread.join()


def holding(spec: KVCacheSpec, count: int, capacity_runs: int = 100, block: int = BLOCK) -> SwaStateCache:
    cache = SwaStateCache(spec, block, capacity_bytes=capacity_runs * spec.bytes_per_token * block)
    for i in range(count):
        cache.put(KEYS[i], run(i, spec, block))
    return cache


def test_a_fetch_brings_the_holders_runs(context: zmq.Context, serve) -> None:
    spec = swa_spec()
    server = serve(holding(spec, 4))
    fetcher = SwaStateFetcher(spec, BLOCK, context)
    fetched = fetcher.fetch(server.endpoint, KEYS[1:4])
    assert fetched.error == ""
    window = fetched.window()
    assert window is not None and len(window) == 3
    assert all(torch.equal(got, run(i, spec)) for got, i in zip(window, (1, 2, 3)))
    # What came can be kept here too.
    mine = SwaStateCache(spec, BLOCK, capacity_bytes=1 << 20)
    assert all(mine.put(key, got) for key, got in zip(KEYS[1:4], window))
    assert (fetcher.num_fetches, fetcher.num_complete, fetcher.num_blocks_fetched) == (1, 1, 3)
    assert (server.num_requests, server.num_blocks_sent, server.num_blocks_missing) == (1, 3, 0)
    fetcher.close()


def test_a_block_evicted_meanwhile_comes_back_missing(context: zmq.Context, serve) -> None:
    spec = swa_spec()
    server = serve(holding(spec, 4, capacity_runs=2))  # KEYS[0] and KEYS[1] were evicted
    fetcher = SwaStateFetcher(spec, BLOCK, context)
    fetched = fetcher.fetch(server.endpoint, KEYS[1:5])
    assert fetched.error == ""
    assert [got is not None for got in fetched.runs] == [False, True, True, False]
    assert torch.equal(fetched.runs[1], run(2, spec))
    assert fetched.window() is None
    assert (fetcher.num_complete, fetcher.num_failed, fetcher.num_blocks_missing) == (0, 0, 2)
    assert server.num_blocks_missing == 2
    fetcher.close()


def test_a_holder_that_is_gone_makes_every_block_missing_after_the_deadline(context: zmq.Context) -> None:
    spec = swa_spec()
    stop = threading.Event()
    server = SwaStateServer(holding(spec, 2), LOOPBACK, context)
    thread = threading.Thread(target=server.serve, args=(stop,))
    thread.start()
    fetcher = SwaStateFetcher(spec, BLOCK, context, timeout_s=SHORT_S)
    assert fetcher.fetch(server.endpoint, KEYS[:2]).window() is not None
    stop.set()
    thread.join()  # the holder's socket is closed: it died
    fetched = fetcher.fetch(server.endpoint, KEYS[:2])
    assert fetched.runs == [None, None]
    assert fetched.error  # not connected within the deadline, or (its disconnection under way) took nothing
    assert (fetcher.num_fetches, fetcher.num_failed, fetcher.num_blocks_missing) == (2, 1, 2)
    fetcher.close()


def test_a_holder_that_never_answers_makes_every_block_missing_after_the_deadline(context: zmq.Context) -> None:
    silent = context.socket(zmq.ROUTER)
    silent.bind(LOOPBACK)
    fetcher = SwaStateFetcher(swa_spec(), BLOCK, context, timeout_s=SHORT_S)
    fetched = fetcher.fetch(silent.getsockopt_string(zmq.LAST_ENDPOINT), KEYS[:3])
    assert fetched.runs == [None, None, None] and "no answer within" in fetched.error
    silent.close()
    fetcher.close()


@pytest.mark.parametrize(
    ("holder_spec", "holder_block", "says"),
    [
        (swa_spec(window=5), BLOCK, "laid out as 'sliding window 5"),
        (swa_spec(dtype=torch.bfloat16), BLOCK, "bfloat16"),
        (swa_spec(), 2 * BLOCK, "its runs are 'float32' [2, 2, 2, 8, 8]"),
    ],
)
def test_a_reply_of_another_layout_is_refused(
    context: zmq.Context, serve, holder_spec: KVCacheSpec, holder_block: int, says: str
) -> None:
    server = serve(holding(holder_spec, 2, block=holder_block))
    fetcher = SwaStateFetcher(swa_spec(), BLOCK, context)
    fetched = fetcher.fetch(server.endpoint, KEYS[:2])
    assert fetched.runs == [None, None]
    assert says in fetched.error
    assert fetcher.num_failed == 1
    fetcher.close()


def ask(endpoint: str, *frames: bytes) -> SwaStateReply:
    with zmq.Context() as context, context.socket(zmq.DEALER) as dealer:
        dealer.connect(endpoint)
        dealer.send_multipart(list(frames))
        assert dealer.poll(10_000), "no reply"
        reply, *runs = dealer.recv_multipart()
        assert runs == []
        return msgspec.msgpack.decode(reply, type=SwaStateReply)


@pytest.mark.parametrize(
    ("frames", "says"),
    [
        ((b"\xc1garbage",), "invalid SWA state request"),
        ((msgspec.msgpack.encode({"type": "swa_state.request", "fetch_id": 1}),), "invalid SWA state request"),
        ((msgspec.msgpack.encode(SwaStateRequest(1, [KEYS[0]])), b"extra"), "one frame, got 2"),
        ((msgspec.msgpack.encode(SwaStateRequest(0, [KEYS[0]])),), "fetch_id is positive"),
        ((msgspec.msgpack.encode(SwaStateRequest(1, [])),), "1 to 256 keys, got 0"),
        ((msgspec.msgpack.encode(SwaStateRequest(1, [KEYS[0]] * (MAX_SWA_STATE_KEYS + 1))),), "got 257"),
    ],
)
def test_a_request_it_cannot_read_is_refused_and_the_server_goes_on(
    context: zmq.Context, serve, frames: tuple[bytes, ...], says: str
) -> None:
    spec = swa_spec()
    server = serve(holding(spec, 2))
    reply = ask(server.endpoint, *frames)
    assert reply.fetch_id == 0 and says in reply.error
    assert server.num_refused == 1
    fetcher = SwaStateFetcher(spec, BLOCK, context)
    assert fetcher.fetch(server.endpoint, KEYS[:2]).window() is not None
    fetcher.close()


class FakeHolder:
    """A holder that answers each request with what `answer(request)` makes of it: a list of messages
    (frames lists), any of them for other fetches."""

    def __init__(self, context: zmq.Context, answer: Callable[[SwaStateRequest], list[list]]) -> None:
        self.router = context.socket(zmq.ROUTER)
        self.router.bind(LOOPBACK)
        self.endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.answer = answer
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            if self.router.poll(20):
                peer, frame = self.router.recv_multipart()
                for message in self.answer(msgspec.msgpack.decode(frame, type=SwaStateRequest)):
                    self.router.send_multipart([peer, *message])

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.router.close()


def reply_frames(spec: KVCacheSpec, fetch_id: int, found: list[bytes], missing=(), **fields) -> list:
    header = SwaStateReply(
        fetch_id,
        kv_layout=spec.layout,
        dtype="float32",
        run_shape=spec.run_shape(BLOCK),
        found=found,
        missing=list(missing),
    )
    header = msgspec.structs.replace(header, **fields)
    return [msgspec.msgpack.encode(header), *(tensor_frame(run(i, spec)) for i in range(len(found)))]


@pytest.mark.parametrize(
    ("forge", "says"),
    [
        (lambda spec, r: [reply_frames(spec, r.fetch_id, [KEYS[9]])], "keys not asked for"),
        (lambda spec, r: [reply_frames(spec, r.fetch_id, [r.keys[0], r.keys[0]])], "keys twice"),
        (lambda spec, r: [reply_frames(spec, r.fetch_id, r.keys)[:-1]], "1 frames for 2 blocks"),
        (lambda spec, r: [[*reply_frames(spec, r.fetch_id, r.keys[:1])[:1], b"short"]], "has 5 bytes, expected"),
        (lambda spec, r: [[b"\xc1"]], "unreadable reply"),
        (lambda spec, r: [reply_frames(spec, r.fetch_id, [], error="busy")], "refused the request: busy"),
    ],
)
def test_a_forged_reply_is_refused_whole(context: zmq.Context, forge, says: str) -> None:
    spec = swa_spec()
    holder = FakeHolder(context, lambda request: forge(spec, request))
    fetcher = SwaStateFetcher(spec, BLOCK, context, timeout_s=SHORT_S)
    fetched = fetcher.fetch(holder.endpoint, KEYS[:2])
    assert fetched.runs == [None, None]
    assert says in fetched.error
    fetcher.close()
    holder.close()


def test_a_late_reply_to_an_earlier_fetch_is_not_taken_for_the_answer(context: zmq.Context) -> None:
    spec = swa_spec()
    held: list[SwaStateRequest] = []

    def answer(request: SwaStateRequest) -> list[list]:
        # The first request is answered only after the second comes, and then first: late.
        if not held:
            held.append(request)
            return []
        return [reply_frames(spec, held[0].fetch_id, held[0].keys), reply_frames(spec, request.fetch_id, [], [KEYS[5]])]

    holder = FakeHolder(context, answer)
    fetcher = SwaStateFetcher(spec, BLOCK, context, timeout_s=SHORT_S)
    assert fetcher.fetch(holder.endpoint, KEYS[:2]).runs == [None, None]
    fetched = fetcher.fetch(holder.endpoint, [KEYS[5]])
    assert fetched.runs == [None] and fetched.error == ""  # the holder's answer to this fetch: missing
    fetcher.close()
    holder.close()


def test_over_curve_a_fetcher_with_the_clusters_key_gets_the_state(context: zmq.Context, serve) -> None:
    spec = swa_spec()
    key = generate_key(1)
    server = serve(holding(spec, 2), key=key)
    fetcher = SwaStateFetcher(spec, BLOCK, context, key=key)
    assert fetcher.fetch(server.endpoint, KEYS[:2]).window() is not None
    fetcher.close()
