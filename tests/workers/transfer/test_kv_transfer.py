"""The prefill → decode KV transfer codec over real ZMQ sockets: round trips, and every malformed
transfer refused with KVTransferError without disturbing the receiver."""

import random
import uuid

import msgspec
import numpy as np
import pytest
import torch
import zmq

from tests.workers.engine.hf_reference import TINY_CONFIGS
from tests.workers.engine.requests import hand_over
from workers.engine import LLM, SamplingParams
from workers.engine.kv_handoff import KVHandoff
from workers.protocol.engine_request import EngineRequest
from workers.protocol.messages import KVTransferChunk, KVTransferHeader
from workers.transfer.frames import MAX_LAYOUT_CHARS, HandoffAssembler, KVTransferError, encode_handoff, send_handoff

NUM_LAYERS = 5


def handoff(request_id: str = "r", dtype: torch.dtype = torch.float32, tokens: int = 21) -> KVHandoff:
    generator = torch.Generator().manual_seed(len(request_id))
    shape = (2, 2, tokens, 8)
    return KVHandoff(
        request_id=request_id,
        prompt_token_ids=list(range(tokens)),
        output_token_ids=[7],
        params=SamplingParams(temperature=0.8, seed=3, max_tokens=9),
        num_computed_tokens=tokens,
        num_cached_tokens=16,
        traffic_class="agent",
        cache_namespace="tenant-a",
        kv_model_id="random:float32",
        kv_dtype=dtype,
        kv_layout=f"full attention of layers 0-{NUM_LAYERS - 1}: 2 KV heads of 8 ({str(dtype).removeprefix('torch.')})",
        token_shape=(2, 2, 8),
        num_layers=NUM_LAYERS,
        layers=[torch.randn(shape, generator=generator).to(dtype) for _ in range(NUM_LAYERS)],
    )


def assert_same(received: KVHandoff, sent: KVHandoff) -> None:
    fields = [f for f in KVHandoff.__slots__ if f != "layers"]
    assert {f: getattr(received, f) for f in fields} == {f: getattr(sent, f) for f in fields}
    assert len(received.layers) == len(sent.layers)
    for got, expected in zip(received.layers, sent.layers, strict=True):
        assert got.dtype == expected.dtype and torch.equal(got, expected)


@pytest.fixture
def pair():
    context = zmq.Context.instance()
    endpoint = f"inproc://kv-{uuid.uuid4().hex}"
    receiver = context.socket(zmq.PAIR)
    receiver.bind(endpoint)
    sender = context.socket(zmq.PAIR)
    sender.connect(endpoint)
    yield sender, receiver
    sender.close(linger=0)
    receiver.close(linger=0)


def deliver(pair, messages) -> list[list[zmq.Frame]]:
    """Send raw messages through the socket pair; the frames as a receiver gets them."""
    sender, receiver = pair
    messages = list(messages)
    for message in messages:
        sender.send_multipart(message, copy=False)
    return [receiver.recv_multipart(copy=False) for _ in messages]


def messages_bytes(sent: KVHandoff, chunk_layers: int = 2) -> list[list[bytes]]:
    return [[bytes(frame) for frame in message] for message in encode_handoff(sent, chunk_layers=chunk_layers)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("chunk_layers", [1, 2, NUM_LAYERS, 8])
def test_round_trip_delivers_the_handoff_when_its_last_chunk_lands(pair, dtype, chunk_layers):
    sent = handoff(dtype=dtype)
    sender, receiver = pair
    send_handoff(sender, sent, chunk_layers=chunk_layers)
    assembler = HandoffAssembler()
    num_messages = -(-NUM_LAYERS // chunk_layers)
    results = [assembler.feed(receiver.recv_multipart(copy=False)) for _ in range(num_messages)]

    assert results[:-1] == [None] * (num_messages - 1)
    assert_same(results[-1], sent)
    assert not assembler.partial


def test_received_layers_are_views_of_the_frames(pair):
    frames = deliver(pair, encode_handoff(handoff(), chunk_layers=NUM_LAYERS))[0]
    received = HandoffAssembler().feed(frames)
    for frame, layer in zip(frames[1:], received.layers, strict=True):
        assert layer.data_ptr() == memoryview_address(frame.buffer)


def memoryview_address(buffer: memoryview) -> int:
    return np.frombuffer(buffer, dtype=np.uint8).ctypes.data


def test_interleaved_transfers_of_two_requests_over_push_pull_ipc(tmp_path):
    context = zmq.Context.instance()
    endpoint = f"ipc://{tmp_path}/kv.sock"
    pull = context.socket(zmq.PULL)
    pull.bind(endpoint)
    push = context.socket(zmq.PUSH)
    push.connect(endpoint)
    try:
        first, second = handoff("a"), handoff("bb", dtype=torch.bfloat16)
        for a, b in zip(encode_handoff(first), encode_handoff(second), strict=True):
            push.send_multipart(a, copy=False)
            push.send_multipart(b, copy=False)
        assembler = HandoffAssembler()
        done = [h for _ in range(2 * NUM_LAYERS) if (h := assembler.feed(pull.recv_multipart(copy=False)))]
    finally:
        push.close(linger=0)
        pull.close(linger=0)
    assert [h.request_id for h in done] == ["a", "bb"]
    assert_same(done[0], first)
    assert_same(done[1], second)


def replace_header(message: list[bytes], **changes) -> list[bytes]:
    header = msgspec.msgpack.decode(message[0], type=KVTransferHeader)
    return [msgspec.msgpack.encode(msgspec.structs.replace(header, **changes)), *message[1:]]


def header_map(message: list[bytes], **changes) -> list[bytes]:
    """The header as a plain map (to write values its struct would refuse), with changes."""
    fields = msgspec.to_builtins(msgspec.msgpack.decode(message[0], type=KVTransferHeader))
    return [msgspec.msgpack.encode({**fields, **changes}), *message[1:]]


MALFORMED = {
    "missing layer frame": lambda m: [m[0][:-1], *m[1:]],
    "extra layer frame": lambda m: [m[0] + [m[0][1]], *m[1:]],
    "truncated layer frame": lambda m: [[*m[0][:-1], m[0][-1][:-1]], *m[1:]],
    "truncated last chunk": lambda m: [*m[:-1], [m[-1][0], m[-1][1][:100]]],
    "dtype not allowed": lambda m: [replace_header(m[0], dtype="int64"), *m[1:]],
    "dtype of another size": lambda m: [replace_header(m[0], dtype="float16"), *m[1:]],
    "shape disagrees with the token count": lambda m: [replace_header(m[0], layer_shape=(2, 2, 20, 8)), *m[1:]],
    "shape of three planes": lambda m: [replace_header(m[0], layer_shape=(3, 2, 21, 8)), *m[1:]],
    "shape of no planes": lambda m: [replace_header(m[0], layer_shape=(0, 2, 21, 8)), *m[1:]],
    "one plane where the frames hold two": lambda m: [replace_header(m[0], layer_shape=(1, 2, 21, 8)), *m[1:]],
    "no layout": lambda m: [replace_header(m[0], kv_layout=""), *m[1:]],
    "a layout too long to be one": lambda m: [replace_header(m[0], kv_layout="x" * (MAX_LAYOUT_CHARS + 1)), *m[1:]],
    "header without a layout": lambda m: [header_map(m[0], kv_layout=None), *m[1:]],
    "negative heads": lambda m: [replace_header(m[0], layer_shape=(2, -2, 21, -8)), *m[1:]],
    "more computed tokens than tokens": lambda m: [
        replace_header(m[0], num_computed_tokens=40, layer_shape=(2, 2, 40, 8)),
        *m[1:],
    ],
    "zero chunk_layers": lambda m: [replace_header(m[0], chunk_layers=0), *m[1:]],
    "chunk_layers differs from the messages": lambda m: [replace_header(m[0], chunk_layers=3), *m[1:]],
    "header garbage": lambda m: [[b"\xc1\xff not msgpack", *m[0][1:]], *m[1:]],
    "header of another type": lambda m: [[msgspec.msgpack.encode({"type": "generate"}), *m[0][1:]], *m[1:]],
    "header with an unknown field": lambda m: [header_map(m[0], extra=1), *m[1:]],
    "header with a bad sampling param": lambda m: [header_map(m[0], params={"temperature": -1.0}), *m[1:]],
    "header with a short shape": lambda m: [header_map(m[0], layer_shape=[2, 2, 21]), *m[1:]],
    "chunk without a header": lambda m: m[1:],
    "chunk out of order": lambda m: [m[0], m[2], m[1]],
    "second header before the end": lambda m: [m[0], m[0]],
    "chunk past the last layer": lambda m: [
        *m,
        [msgspec.msgpack.encode(KVTransferChunk(request_id="r", first_layer=NUM_LAYERS)), m[1][1]],
    ],
}


@pytest.mark.parametrize("name", MALFORMED)
def test_a_malformed_transfer_raises_and_the_receiver_keeps_working(pair, name):
    sent = handoff()
    messages = MALFORMED[name](messages_bytes(sent))
    assembler = HandoffAssembler()
    with pytest.raises(KVTransferError):
        for frames in deliver(pair, messages):
            assembler.feed(frames)
    assert not assembler.partial

    results = [assembler.feed(frames) for frames in deliver(pair, encode_handoff(sent, chunk_layers=2))]
    assert_same(results[-1], sent)


def test_bytes_frames_are_accepted_and_copied():
    sent = handoff()
    assembler = HandoffAssembler()
    with pytest.raises(KVTransferError, match="empty"):
        assembler.feed([])  # ZMQ never delivers one, but a caller could pass it
    results = [assembler.feed(message) for message in messages_bytes(sent)]
    assert_same(results[-1], sent)
    results[-1].layers[0].add_(1)  # writable: a copy, not the immutable bytes


def test_partial_transfers_are_capped_and_can_be_discarded():
    assembler = HandoffAssembler(max_partial=1)
    first = messages_bytes(handoff("a"))
    assembler.feed(first[0])
    with pytest.raises(KVTransferError, match="already being assembled"):
        assembler.feed(messages_bytes(handoff("bb"))[0])
    assembler.discard("a")
    assert not assembler.partial
    assert assembler.feed(messages_bytes(handoff("bb"), chunk_layers=NUM_LAYERS)[0]) is not None


def test_an_engine_handoff_sent_over_zmq_decodes_to_the_same_tokens(pair):
    config = TINY_CONFIGS["qwen3_qknorm_layer_types"]
    rng = random.Random(0)
    tokens = [rng.randrange(128) for _ in range(70)]
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=8, ignore_eos=True)
    expected = LLM(config, seed=0, kv_cache_bytes=1 << 22).generate([tokens], params)[0].token_ids

    prefill = LLM(config, seed=0, kv_cache_bytes=1 << 22).engine
    decode = LLM(config, seed=0, kv_cache_bytes=1 << 22).engine
    prefill.add_request(EngineRequest(request_id="r", prompt_token_ids=tokens, params=params, prefill_only=True))
    (first,) = prefill.step()
    sender, receiver = pair
    send_handoff(sender, prefill.export_kv("r"))
    prefill.release_transfer("r")
    assembler = HandoffAssembler()
    received = None
    while received is None:
        received = assembler.feed(receiver.recv_multipart(copy=False))
    hand_over(decode, received)
    output = list(first.token_ids)
    while decode.has_unfinished():
        output.extend(t for delta in decode.step() for t in delta.token_ids)
    assert output == expected
