"""Requests with images through the gateway's engine client: the encoder with the fewest patches in
flight encodes them for the worker that computes the prompt, at the same time as that worker gets the
request; a failed or silent encoder is replaced once; a second failure, or no encoder, fails the
request "encode_failed" and aborts it on the worker; an encoder's "invalid_request" is final; a rerun
on another worker sends the images to it again. Encoders are never chosen to run a request.

The encoders and workers are scripted stand-ins on real sockets (tests.workers.client.fake_peers): the
encode worker and the worker's side of images are built and tested on their own."""

import asyncio

import pytest
import zmq.asyncio

from tests.workers.client.fake_peers import FakePeer
from workers.client.engine_client import EngineClient
from workers.client.worker_link import RequestRejectedError, WorkerUnavailableError
from workers.engine import SamplingParams
from workers.protocol.encode import EncodeDone, EncodeImage, EncodeRequest
from workers.protocol.images import ImageRef
from workers.protocol.messages import (
    AbortRequest,
    ExpectTransferRequest,
    GenerateError,
    GenerateOutput,
    GenerateRequest,
)

MAX_PIXELS = 1024 * 1024
HEARTBEAT_TIMEOUT_S = 1.0
IMAGE_TOKEN = 99
GREEDY = SamplingParams(temperature=0.0, max_tokens=2)


def image(seed: int, num_patches: int = 8, num_tokens: int = 4) -> EncodeImage:
    return EncodeImage(bytes([seed]) * 32, b"png bytes %d" % seed, num_patches, num_tokens)


def image_request(request_id: str, *images: EncodeImage) -> GenerateRequest:
    prompt = [1, 2]
    for item in images:
        prompt += [IMAGE_TOKEN] * item.num_tokens + [3]
    refs = tuple(ImageRef(item.content_hash, item.num_tokens) for item in images)
    return GenerateRequest(request_id, prompt, GREEDY, images=refs)


class Stack:
    """An engine client (started) following the fake peers made with `peer`."""

    def __init__(self, directory) -> None:
        self.directory = directory
        self.context = zmq.asyncio.Context()
        self.client = EngineClient(self.context, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S, max_image_pixels=MAX_PIXELS)
        self.peers: list[FakePeer] = []

    def peer(self, name: str, role: str, **beat) -> FakePeer:
        peer = FakePeer(self.context, self.directory, name, role, **beat)
        self.peers.append(peer)
        self.client.add_worker(*peer.endpoints)
        return peer

    async def ready(self) -> None:
        async with asyncio.timeout(10):
            while len(self.client.ready_links()) + len(self.client.ready_encoders()) < len(self.peers):
                await asyncio.sleep(0.02)

    async def close(self) -> None:
        await self.client.close()
        for peer in self.peers:
            await peer.close()
        self.context.destroy(linger=0)


def run(directory, scenario) -> None:
    async def go():
        stack = Stack(directory)
        await stack.client.start()
        try:
            await asyncio.wait_for(scenario(stack), 30)
        finally:
            await stack.close()

    asyncio.run(go())


def start(stack: Stack, request: GenerateRequest, images: tuple[EncodeImage, ...]) -> asyncio.Task:
    async def collect():
        return [output async for output in stack.client.generate(request, images)]

    return asyncio.create_task(collect())


async def until(condition) -> None:
    """Wait for the client to have read what the peers sent (over sockets of their own, in no order)."""
    while not condition():
        await asyncio.sleep(0.01)


async def finish(worker: FakePeer, request_id: str) -> None:
    await worker.reply(GenerateOutput(request_id, [5], "a"))
    await worker.reply(GenerateOutput(request_id, [6], "b", finish_reason="length"))


def test_the_request_and_its_images_go_out_at_once_to_the_worker_and_the_encoder(tmp_path):
    async def scenario(stack: Stack):
        worker = stack.peer("w", "mixed", advertised="tcp://w.example:5555", image_token_id=IMAGE_TOKEN)
        encoder = stack.peer("e", "encode")
        await stack.ready()
        images = (image(1, num_patches=12), image(2, num_patches=20))
        request = image_request("r", *images)

        stream = start(stack, request, images)
        encode = await encoder.next(EncodeRequest)
        sent = await worker.next(GenerateRequest)
        link = next(link for link in stack.client.ready_encoders())
        in_flight = dict(link.encoding_patches)
        await encoder.reply(EncodeDone("r", num_patches=32, num_cached=0))
        await finish(worker, "r")
        outputs = await stream
        await until(lambda: not link.encoding_patches)  # done: no longer counted

        # The encoder sends the embeddings where the worker says its requests go, under the request's id.
        assert encode == EncodeRequest("r", images, "tcp://w.example:5555", MAX_PIXELS)
        assert sent == request and sent.images == request.images
        assert in_flight == {"r": 32}
        assert [o.token_ids for o in outputs] == [[5], [6]]

    run(tmp_path, scenario)


def test_the_encoder_with_the_fewest_patches_in_flight_is_chosen_counting_those_sent_and_not_done(tmp_path):
    async def scenario(stack: Stack):
        worker = stack.peer("w", "mixed")
        busy = stack.peer("busy", "encode", patches_in_flight=10)
        idle = stack.peer("idle", "encode", patches_in_flight=0)
        await stack.ready()
        big = (image(1, num_patches=16),)

        links = {link.heartbeat.worker_id: link for link in stack.client.ready_encoders()}

        # idle (0) beats busy (10); once it holds our 16 patches, busy (10) has the fewer
        first = start(stack, image_request("r1", *big), big)
        assert (await idle.next(EncodeRequest)).request_id == "r1"
        second = start(stack, image_request("r2", *big), big)
        assert (await busy.next(EncodeRequest)).request_id == "r2"
        # both are done: idle is back to 0, busy to 10 (counting idle's 16 still, busy would win)
        await idle.reply(EncodeDone("r1", 16, 0))
        await busy.reply(EncodeDone("r2", 16, 0))
        await until(lambda: not links["idle"].encoding_patches and not links["busy"].encoding_patches)
        third = start(stack, image_request("r3", *big), big)
        assert (await idle.next(EncodeRequest)).request_id == "r3"
        for request_id, task in zip(("r1", "r2", "r3"), (first, second, third), strict=True):
            assert (await worker.next(GenerateRequest)).request_id == request_id
            await finish(worker, request_id)
            await task

    run(tmp_path, scenario)


def test_among_encoders_with_as_many_patches_the_one_with_fewer_requests_is_chosen(tmp_path):
    async def scenario(stack: Stack):
        worker = stack.peer("w", "mixed")
        stack.peer("loaded", "encode", patches_in_flight=4, num_running=3)
        light = stack.peer("light", "encode", patches_in_flight=4, num_running=1)
        await stack.ready()
        images = (image(1),)

        stream = start(stack, image_request("r", *images), images)
        await light.next(EncodeRequest)
        await worker.next(GenerateRequest)
        await finish(worker, "r")
        await stream

    run(tmp_path, scenario)


async def receiver_of(request_id: str, encoders: list[FakePeer]) -> FakePeer:
    """The encoder the EncodeRequest of `request_id` went to (the others received nothing)."""
    while True:
        for encoder in encoders:
            if not encoder.received.empty():
                message = encoder.received.get_nowait()
                assert isinstance(message, EncodeRequest) and message.request_id == request_id, message
                return encoder
        await asyncio.sleep(0.005)


def test_encoders_as_loaded_take_the_same_image_each_time_and_share_out_different_ones(tmp_path):
    async def scenario(stack: Stack):
        worker = stack.peer("w", "mixed")
        encoders = [stack.peer(f"e{index}", "encode") for index in range(3)]
        await stack.ready()
        chosen: dict[int, set[str]] = {}
        for round_ in range(2):
            for seed in range(12):
                request_id = f"r{round_}-{seed}"
                images = (image(seed),)
                stream = start(stack, image_request(request_id, *images), images)
                encoder = await receiver_of(request_id, encoders)
                chosen.setdefault(seed, set()).add(encoder.name)
                await encoder.reply(EncodeDone(request_id, 8, 0))
                await worker.next(GenerateRequest)
                await finish(worker, request_id)
                await stream

        assert all(len(names) == 1 for names in chosen.values()), chosen
        assert len(set.union(*chosen.values())) > 1

    run(tmp_path, scenario)


def test_a_failed_encoder_is_replaced_by_another_once(tmp_path):
    async def scenario(stack: Stack):
        worker = stack.peer("w", "mixed")
        first = stack.peer("e0", "encode")
        second = stack.peer("e1", "encode", patches_in_flight=1)
        await stack.ready()
        images = (image(1),)

        stream = start(stack, image_request("r", *images), images)
        await first.next(EncodeRequest)
        await worker.next(GenerateRequest)
        await first.reply(GenerateError("r", "overloaded", "too many patches"))
        again = await second.next(EncodeRequest)
        await second.reply(EncodeDone("r", 8, 0))
        await finish(worker, "r")

        assert again.destination == worker.beat.request_endpoint and again.images == images
        assert [o.finish_reason for o in await stream] == [None, "length"]

    run(tmp_path, scenario)


def test_an_encoder_whose_heartbeats_stop_is_replaced(tmp_path):
    async def scenario(stack: Stack):
        worker = stack.peer("w", "mixed")
        silent = stack.peer("e0", "encode")
        other = stack.peer("e1", "encode", patches_in_flight=1)
        await stack.ready()
        images = (image(1),)

        stream = start(stack, image_request("r", *images), images)
        await silent.next(EncodeRequest)
        await worker.next(GenerateRequest)
        silent.stop_heartbeats()
        again = await other.next(EncodeRequest)
        await other.reply(EncodeDone("r", 8, 0))
        await finish(worker, "r")

        assert again.request_id == "r"
        assert len(await stream) == 2

    run(tmp_path, scenario)


def test_a_second_encoder_failure_fails_the_request_and_aborts_it_on_the_worker(tmp_path):
    async def scenario(stack: Stack):
        worker = stack.peer("w", "mixed")
        encoders = [stack.peer(f"e{i}", "encode", patches_in_flight=i) for i in range(3)]
        await stack.ready()
        images = (image(1),)

        stream = start(stack, image_request("r", *images), images)
        await worker.next(GenerateRequest)
        await encoders[0].next(EncodeRequest)
        await encoders[0].reply(GenerateError("r", "encode_failed", "the vision tower failed"))
        await encoders[1].next(EncodeRequest)
        await encoders[1].reply(GenerateError("r", "internal", "out of memory"))
        with pytest.raises(RequestRejectedError) as failed:
            await stream

        assert failed.value.kind == "encode_failed"
        assert "2 encoders" in failed.value.message and "out of memory" in failed.value.message
        assert await worker.next(AbortRequest) == AbortRequest("r")
        assert encoders[2].received.empty()  # a third encoder is not tried

    run(tmp_path, scenario)


def test_without_an_encoder_a_request_with_images_fails_at_once_and_text_is_still_served(tmp_path):
    async def scenario(stack: Stack):
        worker = stack.peer("w", "mixed")
        await stack.ready()
        images = (image(1),)

        with pytest.raises(RequestRejectedError) as failed:
            await start(stack, image_request("r", *images), images)
        text = start(stack, GenerateRequest("t", [1, 2, 3], GREEDY), ())
        first = await worker.next(GenerateRequest)  # the image request never reached the worker
        await finish(worker, "t")
        await text

        assert failed.value.kind == "encode_failed"
        assert "no encoder is available" in failed.value.message
        assert first.request_id == "t"

    run(tmp_path, scenario)


def test_an_encoders_invalid_request_is_final(tmp_path):
    async def scenario(stack: Stack):
        worker = stack.peer("w", "mixed")
        refusing = stack.peer("e0", "encode")
        spare = stack.peer("e1", "encode", patches_in_flight=1)
        await stack.ready()
        images = (image(1),)

        stream = start(stack, image_request("r", *images), images)
        await refusing.next(EncodeRequest)
        await worker.next(GenerateRequest)
        await refusing.reply(GenerateError("r", "invalid_request", "images[0].data: not an image file"))
        with pytest.raises(RequestRejectedError) as failed:
            await stream

        assert (failed.value.kind, failed.value.message) == ("invalid_request", "images[0].data: not an image file")
        assert await worker.next(AbortRequest) == AbortRequest("r")
        assert spare.received.empty()

    run(tmp_path, scenario)


def test_a_rerun_on_another_worker_sends_the_images_to_it(tmp_path):
    async def scenario(stack: Stack):
        draining = stack.peer("w0", "mixed")
        serving = stack.peer("w1", "mixed", num_running=1)  # w0 is the less loaded: tried first
        encoder = stack.peer("e", "encode")
        await stack.ready()
        images = (image(1),)

        stream = start(stack, image_request("r", *images), images)
        first = await encoder.next(EncodeRequest)
        await draining.next(GenerateRequest)
        await encoder.reply(EncodeDone("r", 8, 0))
        await draining.reply(GenerateError("r", "draining", "the worker is draining"))
        second = await encoder.next(EncodeRequest)
        await serving.next(GenerateRequest)
        await encoder.reply(EncodeDone("r", 8, 0))
        await finish(serving, "r")

        assert len(await stream) == 2
        assert (first.destination, second.destination) == (draining.endpoints[0], serving.endpoints[0])

    run(tmp_path, scenario)


def test_a_split_request_has_its_images_sent_to_the_prefill_worker_which_is_charged_for_them(tmp_path):
    async def scenario(stack: Stack):
        prefill = stack.peer("p", "prefill")
        decode = stack.peer("d", "decode")
        encoder = stack.peer("e", "encode")
        await stack.ready()
        images = (image(1, num_tokens=600), image(2, num_tokens=300))
        request = image_request("r", *images)

        stream = start(stack, request, images)
        expect = await decode.next(ExpectTransferRequest)
        encode = await encoder.next(EncodeRequest)
        routed = await prefill.next(GenerateRequest)
        prefill_link = next(link for link in stack.client.ready_links() if link.role == "prefill")
        queued = prefill_link.queued_prefill_tokens
        await encoder.reply(EncodeDone(encode.request_id, 16, 0))
        await prefill.reply(GenerateOutput(routed.request_id, [5], "a", finish_reason="transfer"))
        await decode.reply(GenerateOutput(routed.request_id, [6], "b", finish_reason="length"))
        outputs = await stream

        # The prefill worker gets the request under the attempt's id, and so do the embeddings.
        assert expect.request_id == encode.request_id == routed.request_id == "r#1"
        assert encode.destination == prefill.endpoints[0] and routed.images == request.images
        # Its 900 image placeholders are prompt tokens the prefill balancer charges.
        assert queued == len(request.prompt_token_ids) == 900 + 4
        assert [o.token_ids for o in outputs] == [[5], [6]]

    run(tmp_path, scenario)


def test_a_draining_encoder_is_replaced_and_not_chosen_again_until_it_heartbeats_otherwise(tmp_path):
    async def scenario(stack: Stack):
        worker = stack.peer("w", "mixed")
        draining = stack.peer("e0", "encode")
        other = stack.peer("e1", "encode", patches_in_flight=100)
        await stack.ready()
        images = (image(1),)

        first = start(stack, image_request("r1", *images), images)
        await draining.next(EncodeRequest)
        draining.stop_heartbeats()  # its last heartbeat still says ready
        await draining.reply(GenerateError("r1", "draining", "the encoder is draining"))
        await other.next(EncodeRequest)
        second = start(stack, image_request("r2", *images), images)
        chosen = await other.next(EncodeRequest)
        for request_id, task in (("r1", first), ("r2", second)):
            assert (await worker.next(GenerateRequest)).request_id == request_id
            await finish(worker, request_id)
            await task

        # e0 has the fewer patches, but said it is draining
        assert chosen.request_id == "r2" and draining.received.empty()

    run(tmp_path, scenario)


def test_an_encoders_garbage_and_answers_for_unknown_requests_are_ignored(tmp_path):
    async def scenario(stack: Stack):
        worker = stack.peer("w", "mixed")
        encoder = stack.peer("e", "encode")
        await stack.ready()
        images = (image(1),)

        stream = start(stack, image_request("r", *images), images)
        await encoder.next(EncodeRequest)
        await encoder.router.send_multipart([encoder.peer, b"\xc1 not msgpack"])
        await encoder.reply(EncodeDone("nobody", 1, 0))
        await encoder.reply(GenerateError("nobody", "encode_failed", "no such request"))
        await encoder.reply(EncodeDone("r", 8, 0))
        await worker.next(GenerateRequest)
        await finish(worker, "r")

        assert len(await stream) == 2

    run(tmp_path, scenario)


def test_a_split_request_whose_images_fail_is_aborted_on_both_its_workers(tmp_path):
    async def scenario(stack: Stack):
        prefill = stack.peer("p", "prefill")
        decode = stack.peer("d", "decode")
        encoder = stack.peer("e", "encode")  # the only encoder: its failure leaves none to retry on
        await stack.ready()
        images = (image(1),)

        stream = start(stack, image_request("r", *images), images)
        await decode.next(ExpectTransferRequest)
        await prefill.next(GenerateRequest)
        encode = await encoder.next(EncodeRequest)
        await encoder.reply(GenerateError(encode.request_id, "overloaded", "no room"))
        with pytest.raises(RequestRejectedError) as failed:
            await stream

        assert failed.value.kind == "encode_failed" and "no other encoder is available" in failed.value.message
        assert await prefill.next(AbortRequest) == await decode.next(AbortRequest) == AbortRequest("r#1")

    run(tmp_path, scenario)


def test_encoders_are_never_chosen_to_run_a_request(tmp_path):
    async def scenario(stack: Stack):
        stack.peer("e", "encode")
        await stack.ready()

        with pytest.raises(WorkerUnavailableError):
            await start(stack, GenerateRequest("t", [1, 2, 3], GREEDY), ())
        assert stack.client.ready_links() == []
        assert [beat.role for beat in stack.client.healthy_workers()] == ["encode"]

    run(tmp_path, scenario)


def test_images_that_are_not_the_requests_are_refused_naming_the_field(tmp_path):
    async def scenario(stack: Stack):
        stack.peer("w", "mixed")
        stack.peer("e", "encode")
        await stack.ready()
        images = (image(1), image(2))
        request = image_request("r", *images)

        with pytest.raises(RequestRejectedError, match=r"images: the request names 2 images") as fewer:
            await start(stack, request, images[:1])
        with pytest.raises(RequestRejectedError, match=r"images\[1\]: its content_hash") as other:
            await start(stack, request, (images[0], image(3)))
        assert fewer.value.kind == other.value.kind == "invalid_request"

    run(tmp_path, scenario)


def test_a_client_without_a_pixel_bound_takes_no_images(tmp_path):
    async def go():
        with zmq.asyncio.Context() as context:
            client = EngineClient(context)
            images = (image(1),)
            with pytest.raises(RequestRejectedError, match="max_image_pixels") as failed:
                await anext(client.generate(image_request("r", *images), images))
            assert failed.value.kind == "internal"
            await client.close()

    asyncio.run(go())
