"""A stand-in for an engine worker's control side: a ZMQ ROUTER on a thread that answers control
commands with ControlAck frames (msgspec msgpack), as the real worker does; or, silent, answers nothing."""

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import msgspec
import zmq

from workers.protocol.messages import (
    ControlAck,
    ControlRequest,
    DrainRequest,
    ResumeRequest,
    ShutdownRequest,
    StatusRequest,
)


class FakeWorker:
    def __init__(self, *, worker_id: str = "fake-0", silent: bool = False, refuse: bool = False) -> None:
        self.worker_id = worker_id
        self.silent = silent
        self.refuse = refuse
        self.state = "ready"
        self.received: list[ControlRequest] = []
        self.endpoint = ""
        self._stop = threading.Event()

    def _answer(self, request: ControlRequest) -> ControlAck:
        if isinstance(request, DrainRequest):
            # As with requests in flight: draining at first, drained by the next status request.
            self.state = "draining"
        elif isinstance(request, StatusRequest) and self.state == "draining":
            self.state = "drained"
        elif isinstance(request, (ResumeRequest, ShutdownRequest)):
            self.state = "ready"
        return ControlAck(
            command_id=request.command_id,
            worker_id=self.worker_id,
            ok=not self.refuse,
            state=self.state,
            message="refused by the test" if self.refuse else "",
        )

    def serve(self, router: zmq.Socket) -> None:
        decoder = msgspec.msgpack.Decoder(ControlRequest)
        while not self._stop.is_set():
            if not router.poll(20):
                continue
            identity, payload = router.recv_multipart()
            request = decoder.decode(payload)
            self.received.append(request)
            if not self.silent:
                router.send_multipart([identity, msgspec.msgpack.encode(self._answer(request))])


@contextmanager
def fake_worker(**options) -> Iterator[FakeWorker]:
    worker = FakeWorker(**options)
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    worker.endpoint = f"tcp://127.0.0.1:{port}"
    thread = threading.Thread(target=worker.serve, args=(router,), daemon=True)
    thread.start()
    try:
        yield worker
    finally:
        worker._stop.set()
        thread.join()
        router.close()
