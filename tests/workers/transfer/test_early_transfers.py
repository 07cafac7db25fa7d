"""KV that reaches a decode worker's receiver before the gateway's expectation of it (they come over
different connections, so nothing orders them), over real ZMQ sockets: held and taken in when the
expectation comes, refused once held too long, past the byte limit, or for a request aborted."""

import time
import uuid

import msgspec
import pytest
import zmq

from tests.workers.transfer.test_kv_transfer import handoff
from workers.protocol.messages import REPLY_FAILED, HostMemoryHandle, KVPoolOffer, KVTransferReply
from workers.transfer import link
from workers.transfer.frames import encode_handoff, encode_offer
from workers.transfer.link import EARLY_HOLD_S, TransferReceiver


@pytest.fixture
def wire():
    """A receiver on a ROUTER and a DEALER that sends it messages as a prefill worker would."""
    context = zmq.Context.instance()
    endpoint = f"inproc://early-{uuid.uuid4().hex}"
    router = context.socket(zmq.ROUTER)
    router.bind(endpoint)
    dealer = context.socket(zmq.DEALER)
    dealer.connect(endpoint)
    yield TransferReceiver(router, default_timeout_s=60.0), dealer
    dealer.close(linger=0)
    router.close(linger=0)


def send(dealer: zmq.Socket, messages) -> None:
    for message in messages:
        dealer.send_multipart(list(message), copy=False)


def settle(receiver: TransferReceiver, expected: int) -> list:
    """Feed the receiver every message sent; the transfers that settled."""
    settled, deadline = [], time.monotonic() + 10
    while time.monotonic() < deadline:
        settled += receiver.receive(64)
        if sum(len(held) for held in receiver.early.values()) + len(settled) >= expected:
            return settled
        time.sleep(0.005)
    raise TimeoutError(f"{expected} messages never arrived")


def pool_offer(request_id: str):
    sent = handoff(request_id, tokens=16)
    pool = KVPoolOffer(
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
    return encode_offer(sent, pool)


def answers(receiver: TransferReceiver, dealer: zmq.Socket) -> list[KVTransferReply]:
    """The receiver's answers to the dealer, once it has taken in every message sent."""
    decoder = msgspec.msgpack.Decoder(KVTransferReply)
    replies, quiet_since = [], time.monotonic()
    while time.monotonic() - quiet_since < 0.5:
        assert receiver.receive(64) == []
        if dealer.poll(20):
            replies.append(decoder.decode(dealer.recv()))
            quiet_since = time.monotonic()
    return replies


def test_frames_that_arrive_before_their_expectation_are_taken_in_when_it_comes(wire):
    receiver, dealer = wire
    sent = handoff("early")
    messages = list(encode_handoff(sent))
    send(dealer, messages)

    assert settle(receiver, len(messages)) == []
    assert len(receiver.early["early"]) == len(messages) and receiver.early_bytes > 0

    settled = receiver.expect("early", b"gateway", None)

    assert [(s.request_id, s.error) for s in settled] == [("early", "")]
    assert settled[0].expectation.peer == b"gateway"
    assert [layer.tolist() for layer in settled[0].handoff.layers] == [layer.tolist() for layer in sent.layers]
    assert receiver.early == {} and receiver.early_bytes == 0 and "early" not in receiver.expected


def test_an_offer_nobody_expects_within_the_hold_is_answered_failed_and_forgotten(wire):
    receiver, dealer = wire
    send(dealer, [pool_offer("orphan")])
    settle(receiver, 1)

    assert receiver.expired(time.monotonic()) == [] and "orphan" in receiver.early
    assert receiver.expired(time.monotonic() + EARLY_HOLD_S + 1) == []

    [answer] = answers(receiver, dealer)
    assert answer.request_id == "orphan" and answer.action == REPLY_FAILED
    assert "no request expects this transfer" in answer.error
    assert receiver.early == {} and receiver.early_bytes == 0
    assert receiver.expect("orphan", b"gateway", None) == []  # too late: it waits for KV sent again


def test_an_offer_for_a_request_aborted_here_is_refused_at_once(wire):
    receiver, dealer = wire
    receiver.expect("aborted", b"gateway", None)
    assert receiver.drop("aborted") is not None
    send(dealer, [pool_offer("aborted")])

    [answer] = answers(receiver, dealer)
    assert answer.action == REPLY_FAILED and "aborted" in answer.error
    assert receiver.early == {}


def test_early_messages_past_the_byte_limit_are_dropped_and_the_rest_kept(wire, monkeypatch):
    receiver, dealer = wire
    first = list(encode_handoff(handoff("first")))
    limit = sum(memoryview(frame).nbytes for message in first for frame in message)
    monkeypatch.setattr(link, "EARLY_MAX_BYTES", limit)
    send(dealer, first)
    settle(receiver, len(first))
    send(dealer, [pool_offer("second")])

    [answer] = answers(receiver, dealer)
    assert answer.request_id == "second" and answer.action == REPLY_FAILED and "already waiting" in answer.error
    settled = receiver.expect("first", b"gateway", None)
    assert [(s.request_id, s.error) for s in settled] == [("first", "")]
