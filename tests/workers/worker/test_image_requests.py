"""Requests with images through real worker processes of a tiny random Idefics3, over real ZMQ
sockets: the test plays the gateway (the GenerateRequest with ImageRefs) and the encode worker (one
ImageEmbeddingsDelivery and raw frame per image, computed with the model's own vision encoder). A
mixed worker, and a prefill worker handing off to a decode worker (pages offered, or frames; and a
drain migrating the request to another decode worker), give the offline engine's greedy tokens
whatever order the deliveries come in. Bad deliveries fail their request "invalid_request" naming
the field, a request whose images never come fails "encode_failed" after the worker's transfer
timeout, an abort ends a waiting request, and the worker serves on."""

import subprocess
import sys
import uuid
from pathlib import Path

import msgspec
import pytest

from tests.workers.engine.hf_idefics3_reference import build_hf_idefics3
from tests.workers.engine.test_vlm_engine import SETTINGS, image_prompt, picture
from tests.workers.worker_process import (
    REPO_ROOT,
    SEED,
    Dealer,
    WorkerProcess,
    endpoints,
    role_options,
    transfer_endpoint,
    wait_for_worker_heartbeat,
)
from workers.engine import LLM, SamplingParams
from workers.engine.image_inputs import ImageEncoder
from workers.protocol.images import ImageEmbeddings, ImageEmbeddingsDelivery, ImageRef
from workers.protocol.messages import (
    AbortRequest,
    ControlAck,
    DrainRequest,
    ExpectTransferRequest,
    GenerateError,
    GenerateOutput,
    GenerateRequest,
    MigrateRequest,
    ResumeDecodeRequest,
    ResumeRequest,
    StatusRequest,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# Enough tokens that a request migrated after its first decode step has most of them still to come.
LONG = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
KV_CACHE_BYTES = 1 << 24
TRANSFER_TIMEOUT_S = 3.0  # the mixed worker's: how long a request waits for its images
SPLIT = picture(60, 44, seed=1)  # a 2 x 2 grid and the global tile
SMALL = picture(30, 20, seed=2)  # one tile


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("idefics3")
    build_hf_idefics3().save_pretrained(path)
    return path


def start(directory: Path, model_dir: Path, name: str, *options: str) -> WorkerProcess:
    request_endpoint, heartbeat_endpoint = endpoints(directory, name)
    command = [
        sys.executable,
        "-m",
        "workers.worker",
        "--model",
        str(model_dir),
        "--request-endpoint",
        request_endpoint,
        "--heartbeat-endpoint",
        heartbeat_endpoint,
        "--seed",
        str(SEED),
        "--kv-cache-bytes",
        str(KV_CACHE_BYTES),
        "--worker-id",
        name,
        *options,
    ]
    return WorkerProcess(subprocess.Popen(command, cwd=REPO_ROOT), (request_endpoint, heartbeat_endpoint))


@pytest.fixture(scope="module")
def workers(model_dir, tmp_path_factory):
    """A mixed worker, prefill workers that offer their pages ("p") or send frames ("pz"), and two
    decode workers."""
    directory = tmp_path_factory.mktemp("img")
    options = {
        "m": ["--role", "mixed", "--transfer-timeout", str(TRANSFER_TIMEOUT_S)],
        "p": role_options(directory, "p", "prefill"),
        "pz": [*role_options(directory, "pz", "prefill"), "--kv-transfer", "zmq"],
        "d0": role_options(directory, "d0", "decode"),
        "d1": role_options(directory, "d1", "decode"),
    }
    started = {name: start(directory, model_dir, name, *flags) for name, flags in options.items()}
    for worker in started.values():
        wait_for_worker_heartbeat(worker.endpoints[1])
    yield directory, started
    assert [worker.stop() for worker in started.values()] == [0] * len(started)


@pytest.fixture(scope="module")
def offline(model_dir):
    """The offline engine of the same model: the reference tokens, and the images' embeddings."""
    llm = LLM(model_dir, seed=0, kv_cache_bytes=KV_CACHE_BYTES, image_settings=SETTINGS)
    encoder = ImageEncoder(llm.engine.runner.model, SETTINGS)
    prompt = image_prompt(SPLIT, SMALL)
    embeddings = [encoder.encode(image)[1] for image in (SPLIT, SMALL)]
    expected = {
        params.max_tokens: llm.generate([prompt], params, images=[[SPLIT, SMALL]])[0].outputs[0].token_ids
        for params in (GREEDY, LONG)
    }
    return prompt, embeddings, expected


def new_id(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"


def refs(embeddings: list[ImageEmbeddings]) -> tuple[ImageRef, ...]:
    return tuple(ImageRef(image.content_hash, image.num_tokens) for image in embeddings)


def delivery(request_id: str, index: int, embeddings: list[ImageEmbeddings], **changes) -> list[bytes]:
    """The two frames of image `index`'s delivery, with `changes` to its fields (`data`: the raw frame)."""
    image = embeddings[index]
    fields = {
        "request_id": request_id,
        "image_index": index,
        "num_images": len(embeddings),
        "content_hash": image.content_hash,
        "num_tokens": image.num_tokens,
        "dtype": image.dtype,
        "shape": image.shape,
        **changes,
    }
    data = fields.pop("data", image.data)
    return [msgspec.msgpack.encode(ImageEmbeddingsDelivery(**fields)), data]


def stream(dealer: Dealer, request_id: str) -> list[GenerateOutput] | GenerateError:
    """The request's outputs up to its last, or the error that ended it."""
    outputs = []
    while True:
        reply = dealer.receive()
        assert reply.request_id == request_id, reply
        if isinstance(reply, GenerateError):
            return reply
        outputs.append(reply)
        if reply.finish_reason is not None:
            return outputs


def tokens_of(outputs: list[GenerateOutput]) -> list[int]:
    return [token for output in outputs for token in output.token_ids]


def serves_a_text_request(worker: WorkerProcess) -> bool:
    with Dealer(worker.endpoints[0]) as dealer:
        dealer.send(GenerateRequest("text", [1, 2, 3], GREEDY))
        outputs = stream(dealer, "text")
    return isinstance(outputs, list) and len(tokens_of(outputs)) == GREEDY.max_tokens


# The order the worker sees the request (R) and the deliveries (0, 1) in, over one connection.
ORDERS = {"before": [0, 1, "R"], "after": ["R", 1, 0], "around": [1, "R", 0]}


@pytest.mark.parametrize("order", ORDERS)
def test_a_mixed_worker_gives_the_offline_tokens_whatever_order_the_images_come_in(workers, offline, order):
    _, started = workers
    prompt, embeddings, expected = offline
    request_id = new_id(order)
    request = GenerateRequest(request_id, prompt, GREEDY, images=refs(embeddings))
    with Dealer(started["m"].endpoints[0]) as dealer:
        for step in ORDERS[order]:
            if step == "R":
                dealer.send(request)
            else:
                dealer.socket.send_multipart(delivery(request_id, step, embeddings))
        outputs = stream(dealer, request_id)

    assert tokens_of(outputs) == expected[GREEDY.max_tokens]
    assert outputs[-1].finish_reason == "length" and outputs[0].num_prompt_tokens == len(prompt)


def test_deliveries_from_an_encoder_s_own_connection_reach_the_request(workers, offline):
    _, started = workers
    prompt, embeddings, expected = offline
    request_id = new_id("apart")
    with Dealer(started["m"].endpoints[0]) as gateway, Dealer(started["m"].endpoints[0]) as encoder:
        encoder.socket.send_multipart(delivery(request_id, 1, embeddings))
        gateway.send(GenerateRequest(request_id, prompt, GREEDY, images=refs(embeddings)))
        encoder.socket.send_multipart(delivery(request_id, 0, embeddings))
        outputs = stream(gateway, request_id)
    assert tokens_of(outputs) == expected[GREEDY.max_tokens]


@pytest.mark.parametrize("prefill", ["p", "pz"], ids=["pool-offer", "frames"])
def test_a_prefill_worker_hands_the_images_on_to_the_decode_worker(workers, offline, prefill):
    directory, started = workers
    prompt, embeddings, expected = offline
    request_id = new_id(prefill)
    request = GenerateRequest(
        request_id, prompt, GREEDY, decode_endpoint=transfer_endpoint(directory, "d0"), images=refs(embeddings)
    )
    with Dealer(started["d0"].endpoints[0]) as decode, Dealer(started[prefill].endpoints[0]) as gateway:
        decode.send(ExpectTransferRequest(request_id))
        gateway.send(request)
        for index in range(len(embeddings)):
            gateway.socket.send_multipart(delivery(request_id, index, embeddings))
        first = stream(gateway, request_id)
        rest = stream(decode, request_id)

    assert [output.finish_reason for output in first] == ["transfer"]
    assert tokens_of(first) + tokens_of(rest) == expected[GREEDY.max_tokens]
    backend = "zmq" if prefill == "pz" else "host_memory"
    beat = wait_for_worker_heartbeat(started["d0"].endpoints[1], lambda b: backend in b.handoff_received)
    assert beat.handoff_received[backend].num_transfers >= 1


def test_a_drained_decode_worker_migrates_an_image_request_with_its_images(workers, offline):
    """The decode worker drains (no grace) after it was told to expect the request: the request is
    offered for migration after its first decode step there, and continues on the other."""
    directory, started = workers
    prompt, embeddings, expected = offline
    request_id, moved_id = new_id("migrating"), new_id("migrated")
    request = GenerateRequest(
        request_id, prompt, LONG, decode_endpoint=transfer_endpoint(directory, "d0"), images=refs(embeddings)
    )
    with (
        Dealer(started["d0"].endpoints[0]) as first_decode,
        Dealer(started["d1"].endpoints[0]) as second_decode,
        Dealer(started["p"].endpoints[0]) as gateway,
    ):
        first_decode.send(ExpectTransferRequest(request_id), DrainRequest("drain-d0", grace_s=0.0))
        drained = first_decode.receive()
        gateway.send(request)
        for index in range(len(embeddings)):
            gateway.socket.send_multipart(delivery(request_id, index, embeddings))
        prefilled = stream(gateway, request_id)
        decoded = stream(first_decode, request_id)
        second_decode.send(ExpectTransferRequest(moved_id))
        first_decode.send(MigrateRequest(request_id, moved_id, transfer_endpoint(directory, "d1")))
        moved = stream(second_decode, moved_id)
        first_decode.send(ResumeRequest("resume-d0"))
        resumed = first_decode.receive()

    assert isinstance(drained, ControlAck) and drained.ok and drained.num_in_flight == 1
    assert decoded[-1].finish_reason == "migrate" and moved[-1].finish_reason == "length"
    assert tokens_of(prefilled) + tokens_of(decoded) + tokens_of(moved) == expected[LONG.max_tokens]
    assert isinstance(resumed, ControlAck) and resumed.ok


def doubled(request_id: str, embeddings: list[ImageEmbeddings]) -> list[bytes]:
    """Image 1's delivery, consistent in itself, with twice the tokens the request names."""
    image = embeddings[1]
    tokens = image.num_tokens * 2
    return delivery(request_id, 1, embeddings, num_tokens=tokens, shape=(tokens, image.shape[1]), data=image.data * 2)


# Per case: the frames an encoder sends (given the request id and the true embeddings), and the field
# the error names.
BAD_DELIVERIES = {
    "three-frames": (lambda r, e: [*delivery(r, 0, e), b"extra"], "two frames"),
    "one-frame": (lambda r, e: delivery(r, 0, e)[:1], "two frames"),
    "wrong-hash": (lambda r, e: delivery(r, 0, e, content_hash=e[1].content_hash), "images[0].content_hash"),
    "wrong-num-tokens": (doubled, "images[1].num_tokens"),
    "short-data": (lambda r, e: delivery(r, 0, e, data=e[0].data[:-4]), "images[0].data"),
    "num-images": (lambda r, e: delivery(r, 0, e, num_images=3), "num_images"),
    "dtype": (lambda r, e: delivery(r, 0, e, dtype="float64"), "images[0].dtype"),
}


@pytest.mark.parametrize("case", BAD_DELIVERIES)
@pytest.mark.parametrize("when", ["before", "after"])
def test_a_bad_delivery_fails_its_request_naming_the_field_and_the_worker_serves_on(workers, offline, case, when):
    _, started = workers
    prompt, embeddings, _ = offline
    request_id = new_id(case)
    frames_of, field = BAD_DELIVERIES[case]
    request = GenerateRequest(request_id, prompt, GREEDY, images=refs(embeddings))
    with Dealer(started["m"].endpoints[0]) as dealer:
        if when == "after":
            dealer.send(request)
        dealer.socket.send_multipart(frames_of(request_id, embeddings))
        if when == "before":
            dealer.send(request)
        error = stream(dealer, request_id)

    assert isinstance(error, GenerateError) and error.kind == "invalid_request"
    assert field in error.message
    assert serves_a_text_request(started["m"])


def test_embeddings_the_engine_refuses_fail_the_request_as_invalid(workers, offline):
    """Consistent with themselves and the request, but not with the model: another hidden size."""
    _, started = workers
    prompt, embeddings, _ = offline
    image = embeddings[0]
    width = image.shape[1] // 2
    narrow = [
        msgspec.structs.replace(
            image, shape=(image.num_tokens, width), data=image.data[: image.num_tokens * width * 4]
        ),
        embeddings[1],
    ]
    request_id = new_id("narrow")
    with Dealer(started["m"].endpoints[0]) as dealer:
        dealer.send(GenerateRequest(request_id, prompt, GREEDY, images=refs(narrow)))
        for index in range(2):
            dealer.socket.send_multipart(delivery(request_id, index, narrow))
        error = stream(dealer, request_id)
    assert isinstance(error, GenerateError) and error.kind == "invalid_request"
    assert "images[0].shape" in error.message


def test_a_request_whose_placeholders_do_not_match_its_images_is_refused_at_once(workers, offline):
    _, started = workers
    prompt, embeddings, _ = offline
    with Dealer(started["m"].endpoints[0]) as dealer:
        dealer.send(GenerateRequest("short", prompt, GREEDY, images=refs(embeddings[:1])))
        error = stream(dealer, "short")
    assert isinstance(error, GenerateError) and error.kind == "invalid_request"
    assert "placeholder" in error.message


def test_a_decode_worker_refuses_image_deliveries_and_image_requests(workers, offline):
    _, started = workers
    prompt, embeddings, _ = offline
    with Dealer(started["d1"].endpoints[0]) as dealer:
        dealer.socket.send_multipart(delivery("to-decode", 0, embeddings))
        refused = dealer.receive()
        dealer.send(GenerateRequest("image-on-decode", prompt, GREEDY, images=refs(embeddings)))
        refused_request = dealer.receive()
        dealer.send(
            ResumeDecodeRequest(
                GenerateRequest("resume", prompt, GREEDY, images=refs(embeddings)), [5], checkpoint_id="gone"
            )
        )
        refused_resume = dealer.receive()

    assert isinstance(refused, GenerateError) and (refused.request_id, refused.kind) == ("to-decode", "invalid_request")
    assert "decode worker" in refused.message
    assert isinstance(refused_request, GenerateError) and refused_request.kind == "invalid_request"
    assert isinstance(refused_resume, GenerateError) and refused_resume.kind == "checkpoint_invalid"
    assert "image request" in refused_resume.message
    assert serves_a_text_request(started["d1"])


def test_a_request_whose_images_never_come_fails_encode_failed_after_the_timeout(workers, offline):
    _, started = workers
    prompt, embeddings, _ = offline
    request_id = new_id("never")
    with Dealer(started["m"].endpoints[0]) as dealer:
        dealer.send(GenerateRequest(request_id, prompt, GREEDY, images=refs(embeddings)))
        dealer.socket.send_multipart(delivery(request_id, 1, embeddings))
        dealer.send(StatusRequest("status-while-waiting"))
        status = dealer.receive()
        error = stream(dealer, request_id)

    assert isinstance(status, ControlAck) and status.num_in_flight == 1
    assert isinstance(error, GenerateError) and error.kind == "encode_failed"
    assert f"1 of its 2 images did not arrive within {TRANSFER_TIMEOUT_S:g} s" in error.message


def test_an_abort_ends_a_waiting_request_and_drops_its_images(workers, offline):
    _, started = workers
    prompt, embeddings, expected = offline
    request_id = new_id("aborted")
    with Dealer(started["m"].endpoints[0]) as dealer:
        dealer.send(GenerateRequest(request_id, prompt, GREEDY, images=refs(embeddings)))
        dealer.socket.send_multipart(delivery(request_id, 0, embeddings))
        dealer.send(AbortRequest(request_id))
        aborted = stream(dealer, request_id)
        # The rest of its images come too late: they are dropped, and the id is free for a new request.
        dealer.socket.send_multipart(delivery(request_id, 1, embeddings))
        dealer.send(StatusRequest("status-after-abort"))
        status = dealer.receive()

    assert isinstance(aborted, list) and [o.finish_reason for o in aborted] == ["abort"]
    assert tokens_of(aborted) == []
    assert isinstance(status, ControlAck) and status.num_in_flight == 0
