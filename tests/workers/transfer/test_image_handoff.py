"""A handoff's images cross the wire with its KV: in the frames' header and in a pool offer, through
real ZMQ sockets, and the receiver's handoff and the EngineRequest that continues it carry them."""

import dataclasses
import time

import zmq

from tests.workers.transfer.test_kv_transfer import assert_same, handoff
from workers.engine.connectors.handoff import continuing
from workers.protocol.images import ImageEmbeddings
from workers.protocol.messages import HostMemoryHandle, KVPoolOffer
from workers.transfer.frames import HandoffAssembler, check_header, decode_lead, encode_offer, handoff_of, send_handoff

IMAGES = (
    ImageEmbeddings(content_hash=b"a" * 32, num_tokens=2, dtype="float32", shape=(2, 4), data=bytes(range(32))),
    ImageEmbeddings(content_hash=b"b" * 32, num_tokens=1, dtype="bfloat16", shape=(1, 4), data=b"\x01" * 8),
)


def pair() -> tuple[zmq.Socket, zmq.Socket]:
    context = zmq.Context.instance()
    pull, push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    endpoint = f"inproc://image-handoff-{time.monotonic_ns()}"
    pull.bind(endpoint)
    push.connect(endpoint)
    return push, pull


def test_frames_carry_the_images_to_the_receiver_s_handoff_and_engine_request():
    sent = dataclasses.replace(handoff("img"), images=IMAGES)
    push, pull = pair()
    try:
        send_handoff(push, sent)
        assembler = HandoffAssembler()
        received = None
        while received is None:
            received = assembler.feed(pull.recv_multipart(copy=False))
    finally:
        push.close(linger=0)
        pull.close(linger=0)

    assert_same(received, sent)
    assert received.images == IMAGES
    assert continuing(received).images == IMAGES


def pool_of(sent) -> KVPoolOffer:
    """An offer of the handoff's one page (never mapped here: only its header is read)."""
    return KVPoolOffer(
        exporter="p",
        pool_id="p/1",
        host_id="host",
        handle=HostMemoryHandle(pid=1, fd=3, num_bytes=1 << 20),
        shape=(5, 2, 2, 8, 16, 8),
        dtype="float32",
        kv_layout=sent.kv_layout,
        pages=[0],
        expires_at=time.monotonic() + 30,
    )


def test_a_pool_offer_carries_the_images():
    sent = dataclasses.replace(handoff("offer", tokens=16), images=IMAGES, pages=(0,))
    (frame,) = encode_offer(sent, pool_of(sent))
    header = decode_lead(frame)
    check_header(header)

    assert header.images == IMAGES
    assert handoff_of(header).images == IMAGES
    assert continuing(handoff_of(header)).images == IMAGES


def test_a_handoff_without_images_carries_none():
    sent = handoff("text", tokens=16)
    received = handoff_of(decode_lead(encode_offer(sent, pool_of(sent))[0]))
    assert received.images == () and continuing(received).images == ()
