"""The encode worker as the worker process runs it (`python -m workers.worker --role encode`): it
registers with role "encode", serves an EncodeRequest, and exits 0 on SIGTERM."""

import signal
import subprocess
import sys

import msgspec
import zmq

from tests.workers.worker.encoder.conftest import PATCHES_PER_TILE, picture, png
from tests.workers.worker_process import REPO_ROOT
from workers.protocol.encode import EncodeDone, EncodeImage, EncodeRequest, EncoderOutbound
from workers.protocol.images import ImageEmbeddingsDelivery
from workers.protocol.messages import RegistrationAck, WorkerRegistration
from workers.text.image_hash import image_content_hash

STARTUP_TIMEOUT_MS = 60_000
TIMEOUT_MS = 10_000


def test_the_worker_process_runs_role_encode(model_dir):
    context = zmq.Context()
    registry = context.socket(zmq.ROUTER)
    registry.bind("tcp://127.0.0.1:0")
    command = [
        sys.executable,
        "-m",
        "workers.worker",
        "--role",
        "encode",
        "--model",
        str(model_dir),
        "--request-endpoint",
        "tcp://127.0.0.1:0",
        "--heartbeat-endpoint",
        "tcp://127.0.0.1:0",
        "--registry-endpoint",
        registry.getsockopt_string(zmq.LAST_ENDPOINT),
        "--worker-id",
        "encoder-p",
        "--pool",
        "encode-a",
        "--max-encode-patches",
        str(4 * PATCHES_PER_TILE),
    ]
    process = subprocess.Popen(command, cwd=REPO_ROOT)
    try:
        assert registry.poll(STARTUP_TIMEOUT_MS), "the encoder never registered"
        peer, payload = registry.recv_multipart()
        registration = msgspec.msgpack.decode(payload, type=WorkerRegistration)
        registry.send_multipart([peer, msgspec.msgpack.encode(RegistrationAck("encoder-p", ok=True))])
        assert (registration.role, registration.pool, registration.model) == ("encode", "encode-a", model_dir.name)
        assert (registration.transfer_endpoint, registration.accelerator_kind) == ("", "cpu")

        gateway = context.socket(zmq.DEALER)
        gateway.connect(registration.request_endpoint)
        destination = context.socket(zmq.ROUTER)
        destination.bind("tcp://127.0.0.1:0")
        image = picture(200, 20, seed=2)  # 3 tiles
        encode = EncodeImage(image_content_hash(image), png(image), num_patches=3 * PATCHES_PER_TILE, num_tokens=12)
        request = EncodeRequest("r1", (encode,), destination.getsockopt_string(zmq.LAST_ENDPOINT), max_pixels=1 << 20)
        gateway.send(msgspec.msgpack.encode(request))

        assert destination.poll(TIMEOUT_MS)
        _, header, data = destination.recv_multipart()
        delivery = msgspec.msgpack.decode(header, type=ImageEmbeddingsDelivery)
        assert (delivery.request_id, delivery.shape, len(data)) == ("r1", (12, 64), 12 * 64 * 4)
        assert gateway.poll(TIMEOUT_MS)
        answer = msgspec.msgpack.decode(gateway.recv(), type=EncoderOutbound)
        assert answer == EncodeDone("r1", num_patches=3 * PATCHES_PER_TILE, num_cached=0)
    finally:
        process.send_signal(signal.SIGTERM)
        returncode = process.wait(timeout=30)
        context.destroy(linger=0)
    assert returncode == 0
