"""A KV handoff between two processes on one GPU: through host memory (the transfer path the workers
use today) against CUDA IPC (device to device), for 8k-token contexts, in one run:

    python3 -m bench.kv_handoff [--tokens 8192] [--runs 5]

Two processes, a sender (the prefill side) and a receiver (the decode side), each with its own CUDA
context on the same GPU. The KV of one request is per layer [2, kv_heads, tokens, head_dim] bf16,
filled from a seeded generator so the receiver can check every byte it got.
- `host`: the workers' path: `workers.transfer.frames.encode_handoff` copies each layer to the host
  and ZMQ carries the frames over ipc:// to a `HandoffAssembler`, which rebuilds the handoff; the
  receiver then copies each layer onto its GPU.
- `cuda_ipc`: the sender shares one staging buffer with the receiver once, at start-up (a CUDA IPC
  handle, opened once: `cuda_ipc_setup_s`, which also holds the sender's start-up); per transfer it copies
  the layers into the staging buffer on the device and says so over ZMQ, and the receiver copies
  them out into its own memory, device to device, and acknowledges.
A transfer's time runs from the sender's start to the receiver holding the last layer on its GPU
(both processes read the same monotonic clock). Reported per model shape: the median over --runs
transfers of each path, its GB/s, and host over CUDA IPC. Needs CUDA; prints one JSON object.

Across GPUs of one host (NCCL send/recv or IPC between devices) is the multi-GPU issue's benchmark:
no multi-GPU machine was lent when this was written.
"""

import argparse
import json
import statistics
import time

import torch
import torch.multiprocessing as mp

# (layers, kv_heads, head_dim): SmolLM2-135M, the model `make run` serves, and a Qwen3-30B-A3B-shaped
# MoE model (48 layers, 4 KV heads of 128).
SHAPES = {"smollm2_135m": (30, 3, 64), "qwen3_30b_a3b": (48, 4, 128)}
DTYPE = torch.bfloat16
SEED = 1234


def kv_layers(shape: tuple[int, int, int], tokens: int, device: torch.device, seed: int) -> list[torch.Tensor]:
    """The request's KV: the same values in both processes for the same seed."""
    layers, heads, head_dim = shape
    generator = torch.Generator(device=device).manual_seed(seed)
    return [
        torch.randn((2, heads, tokens, head_dim), generator=generator, device=device, dtype=torch.float32).to(DTYPE)
        for _ in range(layers)
    ]


def _sender(mode: str, shape, tokens: int, runs: int, address: str, queue) -> None:
    import zmq

    from workers.engine.kv_handoff import KVHandoff
    from workers.engine.sampling_params import SamplingParams
    from workers.transfer.frames import send_handoff

    device = torch.device("cuda")
    context = zmq.Context()
    push = context.socket(zmq.PAIR)
    push.connect(address)
    staging = None
    if mode == "cuda_ipc":
        layers, heads, head_dim = shape
        staging = torch.empty((layers, 2, heads, tokens, head_dim), dtype=DTYPE, device=device)
        queue.put(staging)  # torch shares a CUDA tensor as an IPC handle
    for run in range(runs):
        kv = kv_layers(shape, tokens, device, SEED + run)
        torch.cuda.synchronize()
        push.recv()  # the receiver is ready for this run
        start = time.monotonic()
        if staging is None:
            handoff = KVHandoff(
                request_id=f"r{run}",
                prompt_token_ids=list(range(tokens + 1)),
                output_token_ids=[0],
                params=SamplingParams(max_tokens=1),
                num_computed_tokens=tokens,
                num_cached_tokens=0,
                traffic_class="chat",
                cache_namespace="",
                kv_model_id="bench",
                kv_dtype=DTYPE,
                num_kv_heads=shape[1],
                head_dim=shape[2],
                layers=kv,
            )
            push.send_pyobj(start)
            send_handoff(push, handoff)
        else:
            for index, layer in enumerate(kv):
                staging[index].copy_(layer)
            torch.cuda.synchronize()
            push.send_pyobj(start)
        push.recv()  # done: the staging buffer may be reused
    push.close(linger=0)
    context.term()


def _receive(mode: str, shape, tokens: int, runs: int, address: str, queue) -> list[float]:
    import zmq

    from workers.transfer.frames import HandoffAssembler

    device = torch.device("cuda")
    context = zmq.Context()
    pull = context.socket(zmq.PAIR)
    pull.bind(address)
    layers, heads, head_dim = shape
    own = torch.empty((layers, 2, heads, tokens, head_dim), dtype=DTYPE, device=device)
    staging, setup_s = None, None
    if mode == "cuda_ipc":
        began = time.monotonic()
        staging = queue.get()
        setup_s = time.monotonic() - began
    seconds = []
    for run in range(runs):
        pull.send(b"ready")
        start = pull.recv_pyobj()
        if staging is None:
            assembler, handoff = HandoffAssembler(), None
            while handoff is None:
                handoff = assembler.feed(pull.recv_multipart(copy=False))
            for index, layer in enumerate(handoff.layers):
                own[index].copy_(layer)
        else:
            own.copy_(staging)
        torch.cuda.synchronize()
        seconds.append(time.monotonic() - start)
        if run == runs - 1:
            staging = None  # released before the sender, which owns the memory, may exit
        pull.send(b"done")
        expected = kv_layers(shape, tokens, device, SEED + run)
        if not all(torch.equal(own[index], layer) for index, layer in enumerate(expected)):
            raise AssertionError(f"{mode}: run {run} received KV that differs from what was sent")
    pull.close(linger=0)
    context.term()
    return seconds if setup_s is None else [setup_s, *seconds]


def measure(mode: str, shape, tokens: int, runs: int, address: str) -> tuple[list[float], float | None]:
    spawn = mp.get_context("spawn")
    queue = spawn.Queue()
    sender = spawn.Process(target=_sender, args=(mode, shape, tokens, runs, address, queue))
    sender.start()
    try:
        seconds = _receive(mode, shape, tokens, runs, address, queue)
    finally:
        sender.join(timeout=120)
    if sender.exitcode != 0:
        raise RuntimeError(f"{mode} sender exited with {sender.exitcode}")
    return (seconds[1:], seconds[0]) if mode == "cuda_ipc" else (seconds, None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.kv_handoff needs a CUDA device")
    rows = []
    for name, shape in SHAPES.items():
        layers, heads, head_dim = shape
        nbytes = layers * 2 * heads * args.tokens * head_dim * DTYPE.itemsize
        row = {"model_shape": name, "layers": layers, "kv_heads": heads, "head_dim": head_dim, "kv_bytes": nbytes}
        for mode in ("host", "cuda_ipc"):
            seconds, setup_s = measure(mode, shape, args.tokens, args.runs, f"ipc:///tmp/sluice-kv-handoff-{mode}")
            median = statistics.median(seconds)
            row[f"{mode}_s"] = round(median, 5)
            row[f"{mode}_gb_s"] = round(nbytes / median / 1e9, 2)
            if setup_s is not None:
                row["cuda_ipc_setup_s"] = round(setup_s, 4)
        row["host_over_cuda_ipc"] = round(row["host_s"] / row["cuda_ipc_s"], 2)
        rows.append(row)
    print(
        json.dumps(
            {
                "benchmark": "kv_handoff",
                "device": torch.cuda.get_device_name(),
                "tokens": args.tokens,
                "runs": args.runs,
                "dtype": "bfloat16",
                "rows": rows,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
