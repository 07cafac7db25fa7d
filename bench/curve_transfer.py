"""What CURVE costs the data plane: the workers' own KV transfer path, and a request's round trip,
over tcp:// on loopback, plain and with the cluster's key, in one run:

    python -m bench.curve_transfer [--tokens 2048] [--runs 7] [--round-trips 300]

- transfer: one request's KV (SmolLM2-135M's shape: 30 layers, 3 KV heads of 64; float32, as the CPU
  workers hold it) from a `TransferSender` (the prefill worker's thread: copies each layer and pushes
  it) to a decode worker's PULL read by a `TransferReceiver`, from the submit to the assembled handoff.
  Sender and receiver have a context each, so each side's libzmq I/O thread does its own encryption
  or decryption, as two processes would; the Python work of both shares this process's GIL.
- round trip: a GenerateRequest of 1,000 prompt tokens from a DEALER to a ROUTER and a short answer.
Plain and CURVE runs alternate, so a busy machine slows both alike. Reported: medians, MB/s, and curve
over plain. Prints one JSON object.
"""

import argparse
import json
import os
import platform
import statistics
import time
from dataclasses import replace

import msgspec
import torch
import zmq

from workers import curve
from workers.engine.kv.spec import KVCacheSpec, KVCacheSpecs, KVKind
from workers.engine.kv_handoff import KVHandoff
from workers.protocol.messages import GenerateOutput, GenerateRequest
from workers.protocol.sampling_params import SamplingParams
from workers.transfer.link import TransferReceiver, TransferSender

LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64  # SmolLM2-135M
LOOPBACK = "tcp://127.0.0.1:0"
MODES = ("plain", "curve")


def kv_handoff(tokens: int) -> KVHandoff:
    generator = torch.Generator().manual_seed(0)
    full_attention_spec = KVCacheSpec(
        KVKind.FULL, tuple(range(LAYERS)), torch.float32, page_size=16, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM
    )
    return KVHandoff(
        request_id="r",
        prompt_token_ids=list(range(tokens + 1)),
        output_token_ids=[0],
        params=SamplingParams(max_tokens=1),
        num_computed_tokens=tokens,
        num_cached_tokens=0,
        traffic_class="chat",
        cache_namespace="",
        kv_model_id="bench",
        kv_dtype=torch.float32,
        kv_layout=KVCacheSpecs((full_attention_spec,)).layout,
        token_shape=full_attention_spec.token_shape,
        num_layers=LAYERS,
        layers=[torch.randn((2, KV_HEADS, tokens, HEAD_DIM), generator=generator) for _ in range(LAYERS)],
    )


class TransferPair:
    """A sender and a decode worker's transfer socket on loopback, with `key` (CURVE) or without (plain)."""

    def __init__(self, key: curve.CurveKey | None) -> None:
        self.receiving, self.sending = zmq.Context(), zmq.Context()
        self.router = self.receiving.socket(zmq.ROUTER)
        curve.bind(self.router, LOOPBACK, key)
        self.endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.receiver = TransferReceiver(self.router, default_timeout_s=600.0)
        self.sender = TransferSender(self.sending, key=key, send_timeout_ms=60_000)
        self.count = 0

    def transfer(self, handoff: KVHandoff) -> tuple[float, KVHandoff]:
        self.count += 1
        request_id = f"r{self.count}"
        self.receiver.expect(request_id, b"", None)
        started = time.perf_counter()
        self.sender.submit(request_id, self.endpoint, replace(handoff, request_id=request_id))
        settled = []
        while not settled:
            self.router.poll(1000)
            settled = self.receiver.receive(1024)
        seconds = time.perf_counter() - started
        errors = [result.error for result in self.sender.take_results() if result.error]
        if settled[0].error or errors:
            raise RuntimeError(f"transfer failed: {settled[0].error or errors}")
        return seconds, settled[0].handoff

    def close(self) -> None:
        self.sender.close()
        self.router.close(linger=0)
        self.sending.term()
        self.receiving.term()


def round_trips(key: curve.CurveKey | None, count: int, payload: bytes) -> list[float]:
    with zmq.Context() as context:
        router, dealer = context.socket(zmq.ROUTER), context.socket(zmq.DEALER)
        curve.bind(router, LOOPBACK, key)
        curve.connect(dealer, router.getsockopt_string(zmq.LAST_ENDPOINT), key)
        answer = msgspec.msgpack.encode(GenerateOutput(request_id="r", token_ids=[1], text="a"))
        seconds = []
        for index in range(count + 1):  # the first pays for the connection and the handshake
            started = time.perf_counter()
            dealer.send(payload)
            peer, _ = router.recv_multipart()
            router.send_multipart([peer, answer])
            dealer.recv()
            if index:
                seconds.append(time.perf_counter() - started)
        router.close(linger=0)
        dealer.close(linger=0)
    return seconds


def measure(tokens: int, runs: int, num_round_trips: int) -> dict:
    key = curve.generate_key(1)
    keys = {"plain": None, "curve": key}
    handoff = kv_handoff(tokens)
    kv_bytes = sum(layer.numel() * layer.element_size() for layer in handoff.layers)
    pairs = {mode: TransferPair(keys[mode]) for mode in MODES}
    seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
    try:
        for mode in MODES:  # warm up: connections, handshakes, first allocations
            _, received = pairs[mode].transfer(handoff)
            if not all(torch.equal(a, b) for a, b in zip(received.layers, handoff.layers, strict=True)):
                raise AssertionError(f"{mode}: the KV received differs from the KV sent")
        for _ in range(runs):
            for mode in MODES:
                seconds[mode].append(pairs[mode].transfer(handoff)[0])
    finally:
        for pair in pairs.values():
            pair.close()
    payload = msgspec.msgpack.encode(GenerateRequest("r", list(range(1000)), SamplingParams(max_tokens=16)))
    trips: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(3):
        for mode in MODES:
            trips[mode] += round_trips(keys[mode], num_round_trips // 3, payload)
    transfer = {f"{mode}_s": round(statistics.median(seconds[mode]), 5) for mode in MODES}
    transfer |= {f"{mode}_mb_s": round(kv_bytes / transfer[f"{mode}_s"] / 1e6, 1) for mode in MODES}
    transfer["curve_over_plain"] = round(transfer["curve_s"] / transfer["plain_s"], 3)
    trip = {f"{mode}_us": round(statistics.median(trips[mode]) * 1e6, 1) for mode in MODES}
    trip["curve_over_plain"] = round(trip["curve_us"] / trip["plain_us"], 3)
    return {
        "benchmark": "curve_transfer",
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "zmq": zmq.zmq_version(),
        "tokens": tokens,
        "kv_bytes": kv_bytes,
        "runs": runs,
        "transfer": transfer,
        "round_trips": len(trips["plain"]),
        "request_bytes": len(payload),
        "round_trip": trip,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048, help="tokens of KV in one transfer")
    parser.add_argument("--runs", type=int, default=7, help="transfers per mode")
    parser.add_argument("--round-trips", type=int, default=300, help="request round trips per mode")
    args = parser.parse_args()
    print(json.dumps(measure(args.tokens, args.runs, args.round_trips), indent=2))


if __name__ == "__main__":
    main()
