"""The encode worker's server on real ZMQ sockets, in a thread: a gateway DEALER sends EncodeRequests
and control commands, a destination ROUTER (standing in for a prefill worker) takes the deliveries,
a SUB reads the heartbeats. Embeddings are the offline engine's; the same image twice comes from
the cache; bad input gets "invalid_request" naming the field and the encoder serves on."""

import struct
import threading
import zlib
from dataclasses import dataclass

import msgspec
import numpy as np
import pytest
import torch
import zmq

from tests.workers.worker.encoder.conftest import PATCHES_PER_TILE, SETTINGS, picture, png
from workers.args import EngineArgs
from workers.engine.image_inputs import ImageEncoder
from workers.engine.model_loader import load_model
from workers.protocol.encode import EncodeDone, EncodeImage, EncodeRequest, EncoderOutbound
from workers.protocol.images import ImageEmbeddingsDelivery
from workers.protocol.messages import (
    ControlAck,
    DrainRequest,
    GenerateError,
    ResumeRequest,
    ShutdownRequest,
    StatusRequest,
    WorkerHeartbeat,
)
from workers.text.idefics3_images import image_layout
from workers.text.image_hash import image_content_hash
from workers.worker.args import WorkerArgs
from workers.worker.encoder.server import MAX_QUEUED_BATCHES, EncodeServer
from workers.worker.encoder.vision import load_vision_model

TIMEOUT_MS = 10_000
MAX_TILES = 4  # a batch: the 5 tiles of SPLIT take two
SPLIT = picture(60, 44, seed=1)  # a 2 x 2 grid and the global tile
WIDE = picture(200, 20, seed=2)  # 1 x 2 and the global tile
OTHER = picture(44, 60, seed=3)
MAX_PIXELS = 1 << 20
ENCODE = msgspec.msgpack.Encoder()
ANSWERS = msgspec.msgpack.Decoder(EncoderOutbound)
HEARTBEATS = msgspec.msgpack.Decoder(WorkerHeartbeat)


@pytest.fixture(scope="module")
def vision(model_dir):
    return load_vision_model(EngineArgs(model=model_dir))


@pytest.fixture(scope="module")
def offline(model_dir):
    """The offline engine's encoder: the whole model, its own vision encoder."""
    loaded = load_model(model_dir, device=torch.device("cpu"), dtype=torch.float32, seed=0, max_model_len=None)
    return ImageEncoder(loaded.model, SETTINGS)


@dataclass
class Encoder:
    server: EncodeServer
    thread: threading.Thread
    failure: list[BaseException]
    gateway: zmq.Socket
    destination: zmq.Socket  # a prefill worker's request ROUTER
    destination_endpoint: str
    heartbeats: zmq.Socket

    def send(self, message) -> None:
        self.gateway.send(ENCODE.encode(message))

    def answer(self):
        assert self.gateway.poll(TIMEOUT_MS), "no answer from the encoder"
        return ANSWERS.decode(self.gateway.recv())

    def deliveries(self, count: int) -> list[tuple[ImageEmbeddingsDelivery, bytes]]:
        received = []
        for _ in range(count):
            assert self.destination.poll(TIMEOUT_MS), "no delivery at the destination"
            _, header, data = self.destination.recv_multipart()
            received.append((msgspec.msgpack.decode(header, type=ImageEmbeddingsDelivery), data))
        return received

    def heartbeat_where(self, condition) -> WorkerHeartbeat:
        """The first heartbeat that meets `condition` (the counters trail the answers a little)."""
        while True:
            assert self.heartbeats.poll(TIMEOUT_MS), "no heartbeat"
            beat = HEARTBEATS.decode(self.heartbeats.recv())
            if condition(beat):
                return beat


def started(vision):
    """An EncodeServer of `vision` serving on its thread, with a gateway, a destination and a SUB."""
    context = zmq.Context()
    config = WorkerArgs(
        engine=EngineArgs(model="unused: the model is given"),
        role="encode",
        worker_id="encoder-0",
        request_endpoint="tcp://127.0.0.1:0",
        heartbeat_endpoint="tcp://127.0.0.1:0",
        heartbeat_interval_s=0.02,
        max_encode_patches=MAX_TILES * PATCHES_PER_TILE,
        embedding_cache_bytes=1 << 20,
    )
    stop = threading.Event()
    server = EncodeServer(config, vision, context, stop)
    failure: list[BaseException] = []

    def serve() -> None:
        try:
            server.serve()
        except BaseException as error:
            failure.append(error)

    thread = threading.Thread(target=serve, name="encoder", daemon=True)
    thread.start()
    gateway = context.socket(zmq.DEALER)
    gateway.connect(server.identity.request_endpoint)
    destination = context.socket(zmq.ROUTER)
    destination.bind("tcp://127.0.0.1:0")
    heartbeats = context.socket(zmq.SUB)
    heartbeats.subscribe(b"")
    heartbeats.connect(server.identity.heartbeat_endpoint)
    yield Encoder(
        server, thread, failure, gateway, destination, destination.getsockopt_string(zmq.LAST_ENDPOINT), heartbeats
    )
    stop.set()
    thread.join(timeout=10)
    context.destroy(linger=0)


@pytest.fixture
def encoder(vision):
    yield from started(vision)


@pytest.fixture
def bf16_encoder(model_dir):
    yield from started(load_vision_model(EngineArgs(model=model_dir, dtype="bfloat16")))


def encode_image(image, **changes) -> EncodeImage:
    tiles = image_layout(image.height, image.width, SETTINGS).num_tiles
    fields = {
        "content_hash": image_content_hash(image),
        "data": png(image),
        "num_patches": tiles * PATCHES_PER_TILE,
        "num_tokens": tiles * SETTINGS.image_seq_len,
        **changes,
    }
    return EncodeImage(**fields)


def request(request_id: str, destination: str, *images: EncodeImage, max_pixels: int = MAX_PIXELS) -> EncodeRequest:
    return EncodeRequest(request_id=request_id, images=images, destination=destination, max_pixels=max_pixels)


def as_floats(data: bytes) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(data, dtype=np.float32).copy())


def test_embeddings_reach_the_destination_as_the_offline_engine_computes_them(encoder, offline):
    encoder.send(request("r1", encoder.destination_endpoint, encode_image(SPLIT), encode_image(WIDE)))

    delivered = encoder.deliveries(2)
    done = encoder.answer()

    assert done == EncodeDone("r1", num_patches=(5 + 3) * PATCHES_PER_TILE, num_cached=0)
    assert [header.image_index for header, _ in delivered] == [0, 1]
    for (header, data), image in zip(delivered, (SPLIT, WIDE), strict=True):
        _, expected = offline.encode(image)
        assert (header.request_id, header.num_images, header.content_hash) == ("r1", 2, expected.content_hash)
        assert (header.num_tokens, header.dtype, header.shape) == (expected.num_tokens, "float32", expected.shape)
        ours = as_floats(data).reshape(header.shape)
        torch.testing.assert_close(ours, as_floats(expected.data).reshape(expected.shape), atol=1e-5, rtol=1e-5)


def test_bfloat16_embeddings_go_as_their_raw_bytes(bf16_encoder, offline):
    bf16_encoder.send(request("r1", bf16_encoder.destination_endpoint, encode_image(SPLIT)))

    ((header, data),) = bf16_encoder.deliveries(1)

    assert isinstance(bf16_encoder.answer(), EncodeDone)
    assert (header.dtype, header.shape, len(data)) == ("bfloat16", (20, 64), 20 * 64 * 2)
    ours = torch.frombuffer(bytearray(data), dtype=torch.bfloat16).reshape(header.shape).float()
    expected = as_floats(offline.encode(SPLIT)[1].data).reshape(header.shape)
    torch.testing.assert_close(ours, expected, atol=0.05, rtol=0.05)


def test_the_same_image_again_comes_from_the_cache(encoder):
    encoder.send(request("first", encoder.destination_endpoint, encode_image(SPLIT)))
    ((_, first),) = encoder.deliveries(1)
    assert encoder.answer().num_cached == 0

    encoder.send(request("again", encoder.destination_endpoint, encode_image(OTHER), encode_image(SPLIT)))
    delivered = encoder.deliveries(2)
    done = encoder.answer()

    assert done == EncodeDone("again", num_patches=10 * PATCHES_PER_TILE, num_cached=1)
    # The cached image goes at once, before the one that waits for the vision tower.
    (header, again), _ = delivered
    assert (header.request_id, header.image_index, again) == ("again", 1, first)
    beat = encoder.heartbeat_where(lambda beat: beat.embedding_cache_hits == 1 and beat.num_running == 0)
    assert (beat.role, beat.state, beat.worker_id) == ("encode", "ready", "encoder-0")
    assert beat.embedding_cache_misses == 2  # SPLIT the first time, OTHER
    assert beat.num_patches_encoded == 10 * PATCHES_PER_TILE  # SPLIT encoded once
    assert beat.embedding_cache_bytes == 2 * 5 * SETTINGS.image_seq_len * 64 * 4
    assert beat.patches_in_flight == 0 and beat.patches_per_second > 0


def png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header claims `width` x `height` pixels (a decompression bomb's header)."""
    data = bytearray(png(picture(1, 1, seed=0)))
    ihdr = b"IHDR" + struct.pack(">II", width, height) + bytes(data[24:29])
    data[12:29] = ihdr
    data[29:33] = struct.pack(">I", zlib.crc32(ihdr))
    return bytes(data)


BAD_REQUESTS = {
    "garbage frame": (lambda to: [b"\xc1 not msgpack"], "", "malformed"),
    "two frames": (lambda to: [ENCODE.encode(request("bad", to, encode_image(SPLIT))), b"x"], "", "one message frame"),
    "no images": (
        lambda to: [
            ENCODE.encode({"type": "encode", "request_id": "bad", "images": [], "destination": to, "max_pixels": 1})
        ],
        "bad",
        "images",
    ),
    "truncated png": (
        lambda to: [ENCODE.encode(request("bad", to, encode_image(SPLIT, data=png(SPLIT)[:200])))],
        "bad",
        "images[0].data: cannot be decoded",
    ),
    "not an image": (
        lambda to: [ENCODE.encode(request("bad", to, encode_image(SPLIT, data=b"GIF89a? no")))],
        "bad",
        "images[0].data: not a PNG",
    ),
    "over max_pixels": (
        lambda to: [ENCODE.encode(request("bad", to, encode_image(SPLIT), max_pixels=60 * 44 - 1))],
        "bad",
        "images[0].data: a 60x44 image has more than max_pixels (2639)",
    ),
    "bomb header": (
        lambda to: [
            ENCODE.encode(request("bad", to, encode_image(SPLIT), encode_image(SPLIT, data=png_claiming(5000, 5000))))
        ],
        "bad",
        "images[1].data: a 5000x5000 image has more than max_pixels",
    ),
    "bomb past pillow": (
        lambda to: [ENCODE.encode(request("bad", to, encode_image(SPLIT, data=png_claiming(100_000, 100_000))))],
        "bad",
        "images[0].data: more pixels than Pillow decodes",
    ),
    "hash mismatch": (
        lambda to: [ENCODE.encode(request("bad", to, encode_image(SPLIT, content_hash=image_content_hash(OTHER))))],
        "bad",
        "images[0].content_hash",
    ),
    "num_tokens": (
        lambda to: [ENCODE.encode(request("bad", to, encode_image(SPLIT, num_tokens=4)))],
        "bad",
        "images[0].num_tokens: the encoder lays this 60x44 image out as 5 tiles, 20 tokens; the request says 4",
    ),
    "num_patches": (
        lambda to: [ENCODE.encode(request("bad", to, encode_image(SPLIT, num_patches=1)))],
        "bad",
        "images[0].num_patches",
    ),
    "destination scheme": (
        lambda to: [ENCODE.encode(request("bad", "udp://127.0.0.1:5", encode_image(SPLIT)))],
        "bad",
        "destination: 'udp://127.0.0.1:5' is not a tcp or ipc endpoint",
    ),
    "remote destination without a key": (
        lambda to: [ENCODE.encode(request("bad", "tcp://10.1.2.3:7000", encode_image(SPLIT)))],
        "bad",
        "destination: refusing tcp://10.1.2.3:7000 without the cluster's CURVE key",
    ),
}


@pytest.mark.parametrize("case", BAD_REQUESTS)
def test_bad_input_is_refused_by_field_and_the_encoder_serves_on(encoder, case):
    frames, request_id, field = BAD_REQUESTS[case]

    encoder.gateway.send_multipart(frames(encoder.destination_endpoint))
    refusal = encoder.answer()

    assert isinstance(refusal, GenerateError)
    assert (refusal.request_id, refusal.kind) == (request_id, "invalid_request")
    assert field in refusal.message
    encoder.send(request("good", encoder.destination_endpoint, encode_image(WIDE)))
    ((header, _),) = encoder.deliveries(1)  # nothing came for the refused request
    assert header.request_id == "good"
    assert encoder.answer() == EncodeDone("good", num_patches=3 * PATCHES_PER_TILE, num_cached=0)


def test_a_draining_encoder_refuses_new_requests_until_resumed(encoder):
    encoder.send(DrainRequest("drain-1"))
    assert encoder.answer() == ControlAck("drain-1", "encoder-0", ok=True, state="drained")

    encoder.send(request("r1", encoder.destination_endpoint, encode_image(SPLIT)))
    refusal = encoder.answer()
    assert (refusal.request_id, refusal.kind) == ("r1", "draining")
    assert encoder.heartbeat_where(lambda beat: beat.state == "drained")

    encoder.send(ResumeRequest("resume-1"))
    assert encoder.answer().state == "ready"
    encoder.send(request("r1", encoder.destination_endpoint, encode_image(SPLIT)))
    encoder.deliveries(1)
    assert isinstance(encoder.answer(), EncodeDone)
    encoder.send(StatusRequest("status-1"))
    assert encoder.answer() == ControlAck("status-1", "encoder-0", ok=True, state="ready")


def test_shutdown_acknowledges_and_stops_the_server(encoder):
    encoder.send(ShutdownRequest("stop-1"))

    assert encoder.answer() == ControlAck("stop-1", "encoder-0", ok=True, state="stopping")
    encoder.thread.join(timeout=10)
    assert not encoder.thread.is_alive() and encoder.failure == []


def test_a_failing_vision_tower_fails_the_requests_in_flight_and_ends_the_server(encoder, monkeypatch):
    encoder.heartbeat_where(lambda beat: True)  # serving: the start-up measurement is over

    def broken(pixels):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(encoder.server.model.encoder, "forward", broken)
    encoder.send(request("r1", encoder.destination_endpoint, encode_image(SPLIT)))

    failed = encoder.answer()
    assert (failed.request_id, failed.kind) == ("r1", "encode_failed")
    assert "failed: RuntimeError" in failed.message
    encoder.thread.join(timeout=10)
    assert [type(error) for error in encoder.failure] == [RuntimeError]


def test_a_request_past_the_patches_an_encoder_holds_is_refused_as_overloaded(encoder):
    """One request alone always runs, however large; another that would go past the encoder's
    MAX_QUEUED_BATCHES of patches while it runs is refused, and taken once it is done."""
    many = [encode_image(picture(60, 44, seed=100 + index)) for index in range(64)]
    assert sum(image.num_patches for image in many) > MAX_QUEUED_BATCHES * MAX_TILES * PATCHES_PER_TILE

    encoder.send(request("large", encoder.destination_endpoint, *many))
    encoder.send(request("small", encoder.destination_endpoint, encode_image(WIDE)))

    refusal = encoder.answer()
    assert (refusal.request_id, refusal.kind) == ("small", "overloaded")
    assert len(encoder.deliveries(64)) == 64
    assert encoder.answer() == EncodeDone("large", num_patches=64 * 5 * PATCHES_PER_TILE, num_cached=0)
    encoder.send(request("small", encoder.destination_endpoint, encode_image(WIDE)))
    encoder.deliveries(1)
    assert encoder.answer() == EncodeDone("small", num_patches=3 * PATCHES_PER_TILE, num_cached=0)
