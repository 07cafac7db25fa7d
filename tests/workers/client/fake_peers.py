"""Stand-ins for the processes the gateway's engine client talks to, where the test needs to script
them (an encoder failing, a worker holding a request): a ROUTER that records every message it gets and
answers as told, and a PUB that sends heartbeats until told to stop. Real ZMQ sockets, in the test's
event loop."""

import asyncio
import contextlib
import time
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio

from workers.protocol.encode import EncoderInbound
from workers.protocol.messages import WorkerHeartbeat, WorkerInbound

HEARTBEAT_INTERVAL_S = 0.05


class FakePeer:
    """A worker or an encoder of role `role`; its heartbeats advertise `advertised` as its request
    endpoint (default: the one it binds), with the other heartbeat fields in `beat`."""

    def __init__(
        self, context: zmq.asyncio.Context, directory: Path, name: str, role: str, advertised: str = "", **beat
    ) -> None:
        self.name = name
        self.endpoints = (f"ipc://{directory}/{name}.req", f"ipc://{directory}/{name}.hb")
        fields = {
            "worker_id": name,
            "role": role,
            "model": "m",
            "request_endpoint": advertised or self.endpoints[0],
            "max_model_len": 4096,
            "num_running": 0,
            "num_waiting": 0,
            "kv_usage": 0.0,
            "num_free_pages": 1024,
            "num_prompt_tokens": 0,
            "num_cached_prompt_tokens": 0,
            "num_preemptions": 0,
            "sent_at": 0.0,
            "started_at": time.time(),
            "transfer_endpoint": f"ipc://{directory}/{name}.kv" if role == "decode" else "",
            "kv_capacity_tokens": 1 << 16,
            "max_num_seqs": 64,
        }
        self.beat = WorkerHeartbeat(**{**fields, **beat})
        self.router = context.socket(zmq.ROUTER)
        self.publisher = context.socket(zmq.PUB)
        self.router.bind(self.endpoints[0])
        self.publisher.bind(self.endpoints[1])
        self.received: asyncio.Queue = asyncio.Queue()
        self.peer = b""  # the identity of the client's DEALER, once it sent something
        self._decoder = msgspec.msgpack.Decoder(WorkerInbound | EncoderInbound)
        self._encoder = msgspec.msgpack.Encoder()
        self._tasks = [asyncio.create_task(self._heartbeats()), asyncio.create_task(self._receive())]

    async def next(self, kind: type, timeout_s: float = 10.0):
        """The next message received, which must be a `kind`."""
        message = await asyncio.wait_for(self.received.get(), timeout_s)
        assert isinstance(message, kind), f"{self.name} got {message!r}, expected a {kind.__name__}"
        return message

    async def reply(self, message: msgspec.Struct) -> None:
        await self.router.send_multipart([self.peer, self._encoder.encode(message)])

    def stop_heartbeats(self) -> None:
        self._tasks[0].cancel()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self._tasks)
        self.router.close(linger=0)
        self.publisher.close(linger=0)

    async def _heartbeats(self) -> None:
        while True:
            beat = msgspec.structs.replace(self.beat, sent_at=time.time())
            await self.publisher.send(self._encoder.encode(beat))
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

    async def _receive(self) -> None:
        while True:
            self.peer, payload = await self.router.recv_multipart()
            self.received.put_nowait(self._decoder.decode(payload))
