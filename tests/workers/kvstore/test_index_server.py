"""The index served over ipc: a request it cannot read gets an error reply in the protocol's shape and
the server goes on; a call the index fails is an error reply too; only ipc:// endpoints; a client
without its server fails at once and recovers when the server comes; a late reply is not taken for
the answer to a later call."""

import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import redis
import zmq

from workers.kvstore.index import IndexUsage
from workers.kvstore.index_messages import KVIndexReply, KVIndexUsage
from workers.kvstore.index_server import IndexServer
from workers.kvstore.memory_index import MemoryIndex
from workers.kvstore.redis_index import RedisIndex
from workers.kvstore.remote_index import RemoteIndex, RemoteIndexError
from workers.kvstore.store import open_index


@pytest.fixture
def runtime() -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="kvidx-"))  # ipc paths must be short
    yield directory
    shutil.rmtree(directory)


class Served:
    """An IndexServer on a thread."""

    def __init__(self, index, endpoint: str) -> None:
        self.context = zmq.Context()
        self.stop = threading.Event()
        self.server = IndexServer(index, endpoint, self.context)
        self.thread = threading.Thread(target=self.server.serve, args=(self.stop,))
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.context.destroy(linger=0)


def ask(endpoint: str, *frames: bytes) -> KVIndexReply:
    with zmq.Context() as context, context.socket(zmq.DEALER) as dealer:
        dealer.connect(endpoint)
        dealer.send_multipart(list(frames))
        assert dealer.poll(10_000), "no reply"
        return msgspec.msgpack.decode(dealer.recv(), type=KVIndexReply)


def test_a_request_it_cannot_read_gets_an_error_reply_and_the_server_goes_on(runtime: Path) -> None:
    endpoint = f"ipc://{runtime}/index"
    served = Served(MemoryIndex(), endpoint)
    try:
        garbage = ask(endpoint, b"\xff\x00 not msgpack")
        unknown = ask(endpoint, msgspec.msgpack.encode({"type": "kv_index.drop_everything", "call_id": 5}))
        two_frames = ask(endpoint, b"a", b"b")
        answered = ask(endpoint, msgspec.msgpack.encode(KVIndexUsage(7)))
    finally:
        served.close()

    assert garbage.call_id == 0 and garbage.error.startswith("invalid KV index request")
    assert unknown.call_id == 0 and "invalid KV index request" in unknown.error
    assert two_frames.error == "a KV index request is one frame, got 2"
    assert answered.error == "" and answered.call_id == 7
    assert msgspec.msgpack.decode(answered.result, type=IndexUsage) == IndexUsage(num_blocks=0, num_bytes=0)


def test_a_call_the_index_fails_is_an_error_for_the_caller_alone(runtime: Path) -> None:
    # given a server whose index is a Redis nobody listens on
    endpoint = f"ipc://{runtime}/index"
    served = Served(RedisIndex(redis.Redis.from_url("redis://127.0.0.1:1/0"), "unreachable"), endpoint)
    try:
        # when a client calls it
        # then it gets an error naming what failed there
        with pytest.raises(RemoteIndexError, match="failed: KVIndexUsage failed: .*Connection refused"):
            RemoteIndex(endpoint, context=served.context).usage()
    finally:
        served.close()


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:7999", "tcp://*:7999", "ipc://", "inproc://index"])
def test_only_ipc_endpoints_are_served_or_used(endpoint: str) -> None:
    with pytest.raises(ValueError, match="ipc:// endpoints only"):
        IndexServer(MemoryIndex(), endpoint, zmq.Context.instance())
    with pytest.raises(ValueError, match="ipc:// endpoints only"):
        RemoteIndex(endpoint)
    if endpoint.startswith("tcp"):
        with pytest.raises(ValueError, match="unknown KV index URL"):
            open_index(endpoint)


def test_a_client_without_its_server_fails_at_once_and_recovers_when_it_comes(runtime: Path) -> None:
    # given a client whose server is not up
    endpoint = f"ipc://{runtime}/index"
    client = open_index(endpoint)
    assert isinstance(client, RemoteIndex)

    # then its calls fail as not up (not after waiting for a reply)
    with pytest.raises(RemoteIndexError, match="is not up"):
        client.match_prefix([b"k" * 16])

    # when the server comes up, its calls are answered
    index = MemoryIndex()
    served = Served(index, endpoint)
    try:
        deadline = 50
        while True:
            try:
                usage = client.usage()
                break
            except RemoteIndexError:
                deadline -= 1
                assert deadline, "the client never reconnected"
                served.stop.wait(0.1)
    finally:
        served.close()
    assert usage == IndexUsage(num_blocks=0, num_bytes=0)


def test_a_late_reply_is_dropped_and_the_call_gets_its_own(runtime: Path) -> None:
    # given a server that answers an earlier call's id first (that call timed out), then this one's
    endpoint = f"ipc://{runtime}/index"
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.bind(endpoint)

    def answer_late_then_right() -> None:
        peer, frame = router.recv_multipart()
        request = msgspec.msgpack.decode(frame, type=KVIndexUsage)
        for call_id, blocks in ((request.call_id - 1, 99), (request.call_id, 3)):
            result = msgspec.Raw(msgspec.msgpack.encode(IndexUsage(num_blocks=blocks, num_bytes=0)))
            router.send_multipart([peer, msgspec.msgpack.encode(KVIndexReply(call_id, result=result))])

    thread = threading.Thread(target=answer_late_then_right)
    thread.start()
    try:
        # when the client calls
        usage = RemoteIndex(endpoint, context=context).usage()
    finally:
        thread.join()
        context.destroy(linger=0)

    # then it takes the reply to its own call
    assert usage == IndexUsage(num_blocks=3, num_bytes=0)
