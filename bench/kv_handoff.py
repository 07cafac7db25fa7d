"""A KV handoff between two processes of one host through the workers' transfer backends
(workers.transfer), frames against pages, in one run:

    python3 -m bench.kv_handoff [--tokens 8192] [--runs 5] [--device cpu]

Two processes, a sender (the prefill side) and a receiver (the decode side), each with its own paged
KV cache (workers.engine.kv.kv_cache, no model; on a GPU each with its own CUDA context), the sender's
filled from a seeded generator. Each run hands one request's KV, `--tokens` tokens, from pages scattered over the
sender's cache into pages of the receiver's, as a worker does:
- `zmq`: frames through host memory: the sender's TransferSender reads the pages layer by layer
  (PagedLayers) onto ZMQ over ipc://, the receiver's TransferReceiver assembles them and write_layers
  puts them into its pages.
- `pages`: the sender offers its pages (PoolExport.offer); the receiver maps the sender's cache once
  (PoolMaps.open: `pages_setup_s`) and copies the pages (PageCopy), then answers "done": device to
  device on a side stream over CUDA IPC on a GPU, memory to memory from a shared-memory cache on the
  CPU (`--device cpu`, small shapes).
A run's time goes from the sender's submit to the KV being in the receiver's pages (both processes
read the same monotonic clock); the receiver checks every byte. Reported per model shape: the median
over --runs of each backend, its GB/s, and frames over pages. Prints one JSON object.
"""

import argparse
import json
import os
import statistics
import time

import torch
import torch.multiprocessing as mp

from bench.shapes import SHAPES as MODEL_SHAPES
from bench.shapes import kv_specs

DTYPE = torch.bfloat16
PAGE_SIZE = 16
SEED = 1234
MODES = ("zmq", "pages")
# How long one run may take to arrive before the benchmark gives up on it (a stalled transfer).
RUN_TIMEOUT_S = 120.0


def kv_cache(shape: str, num_pages: int, seed: int | None, device: str):
    """A paged cache of the KV of `shape` (a name of bench.shapes), filled from `seed` unless None."""
    from workers.engine.kv.kv_cache import KVCache

    specs = kv_specs(shape, dtype=DTYPE, page_size=PAGE_SIZE)
    cache = KVCache(specs, num_pages=num_pages, device=torch.device(device), shareable=True)
    if seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
        for layer in cache.pages:
            layer.copy_(torch.randn(layer.shape, generator=generator, device=device, dtype=torch.float32))
    return cache


def scattered_pages(num_pages: int, count: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randperm(num_pages - 1, generator=generator)[:count] + 1).tolist()


def handoff_of(request_id: str, cache, pages: list[int], tokens: int):
    from workers.engine.kv_handoff import KVHandoff, PagedLayers
    from workers.protocol.sampling_params import SamplingParams

    layers = PagedLayers(cache, pages, tokens)
    return KVHandoff(
        request_id=request_id,
        prompt_token_ids=[0] * tokens,
        output_token_ids=[0],
        params=SamplingParams(max_tokens=2),
        num_computed_tokens=tokens,
        num_cached_tokens=0,
        traffic_class="chat",
        cache_namespace="",
        kv_model_id="bench",
        kv_dtype=DTYPE,
        kv_layout=layers.layout,
        token_shape=layers.token_shape,
        num_layers=len(layers),
        layers=layers,
        pages=tuple(pages),
    )


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _sender(mode: str, shape: str, tokens: int, runs: int, endpoint: str, ready, starts, device: str) -> None:
    import zmq

    from workers.transfer.link import TransferSender
    from workers.transfer.pools import PoolExport

    num_pages = 2 * -(-tokens // PAGE_SIZE) + 1
    cache = kv_cache(shape, num_pages, SEED, device)
    pool = PoolExport.of(cache, "bench-sender") if mode == "pages" else None
    _synchronize(device)
    context = zmq.Context()
    sender = TransferSender(context, send_timeout_ms=60_000)
    try:
        for run in range(runs):
            pages = scattered_pages(num_pages, -(-tokens // PAGE_SIZE), SEED + run)
            ready.get()  # the receiver expects this run
            handoff = handoff_of(f"r{run}", cache, pages, tokens)
            offer = pool.offer(pages, 60.0) if pool is not None else None
            starts.put((run, time.monotonic(), pages))
            sender.submit(f"r{run}", endpoint, handoff, offer)
            while not (results := sender.take_results()):
                sender.results.poll(1000)
            if results[0].error:
                raise RuntimeError(f"{mode} run {run}: {results[0].error}")
        # A sent result means the frames are queued, not delivered: closing now could drop the last
        # run's, so the sender stays until the receiver has them all.
        ready.get()
    finally:
        sender.close()
        context.term()


def _receive(
    mode: str, shape: str, tokens: int, runs: int, endpoint: str, ready, starts, device: str, sender
) -> tuple[list[float], float | None]:
    import zmq

    from workers.engine.kv.kv_pages import gather_tokens
    from workers.engine.kv_handoff import write_layers
    from workers.protocol.messages import REPLY_DONE
    from workers.transfer.link import TransferReceiver
    from workers.transfer.page_copy import PageCopy
    from workers.transfer.pools import PoolMaps

    num_pages = 2 * -(-tokens // PAGE_SIZE) + 1
    own = kv_cache(shape, num_pages, None, device)
    reference = kv_cache(shape, num_pages, SEED, device)  # what the sender's cache holds
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.bind(endpoint)
    receiver = TransferReceiver(router, default_timeout_s=600.0, kv_layout=own.specs.layout)
    maps, stream = PoolMaps(), torch.cuda.Stream() if device == "cuda" else None
    seconds, setup_s = [], None
    try:
        for run in range(runs):
            receiver.expect(f"r{run}", b"", None)
            ready.put(run)
            placed = scattered_pages(num_pages, -(-tokens // PAGE_SIZE), 99 + run)
            settled, deadline = [], time.monotonic() + RUN_TIMEOUT_S
            while not settled:
                router.poll(1000)
                settled = receiver.receive(1024)
                # A sender that died or stalled ends the benchmark with an error, not a wait forever.
                if not settled and not sender.is_alive():
                    raise RuntimeError(f"{mode} run {run}: the sender exited with {sender.exitcode} before its KV came")
                if not settled and time.monotonic() > deadline:
                    raise TimeoutError(f"{mode} run {run}: no KV within {RUN_TIMEOUT_S:g} s")
            received = settled[0]
            if received.error:
                raise RuntimeError(f"{mode} run {run}: {received.error}")
            if received.offer is not None:
                began = time.monotonic()
                pool = maps.open(received.offer, own.specs.layout)
                setup_s = setup_s if setup_s is not None else time.monotonic() - began
                copy = PageCopy.start(pool, received.offer.pages, own.pages, placed, stream)
                while not copy.done():
                    pass
                receiver.reply(received.sender, received.request_id, REPLY_DONE)
            else:
                write_layers(own, placed, received.handoff.layers, start=0)
                _synchronize(device)
            end = time.monotonic()
            _, start, pages = starts.get()
            seconds.append(end - start - (setup_s if run == 0 and setup_s is not None else 0.0))
            sent, got = torch.tensor(pages, device=device), torch.tensor(placed, device=device)
            for planes, own_planes in zip(reference.layers, own.layers, strict=True):
                for plane, own_plane in zip(planes, own_planes, strict=True):
                    if not torch.equal(gather_tokens(plane, sent, tokens), gather_tokens(own_plane, got, tokens)):
                        raise AssertionError(f"{mode}: run {run} received KV that differs from what was sent")
        ready.put(None)  # every run is in: the sender may close
    finally:
        router.close(linger=0)
        context.term()
    return seconds, setup_s


def measure(mode: str, shape: str, tokens: int, runs: int, device: str) -> tuple[list[float], float | None]:
    spawn = mp.get_context("spawn")
    # One queue each way: the receiver says it expects a run, the sender when it started it.
    ready, starts = spawn.Queue(), spawn.Queue()
    # This process's own socket: a benchmark run beside it (another test run, a stale one) binds its own.
    endpoint = f"ipc:///tmp/sluice-kv-handoff-{mode}-{os.getpid()}"
    sender = spawn.Process(target=_sender, args=(mode, shape, tokens, runs, endpoint, ready, starts, device))
    sender.start()
    try:
        result = _receive(mode, shape, tokens, runs, endpoint, ready, starts, device, sender)
    except BaseException:
        sender.terminate()
        raise
    finally:
        sender.join(timeout=300)
    if sender.exitcode != 0:
        raise RuntimeError(f"{mode} sender exited with {sender.exitcode}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument(
        "--shapes", default=",".join(MODEL_SHAPES), help="comma-separated, of " + ", ".join(MODEL_SHAPES)
    )
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench.kv_handoff --device cuda needs a CUDA device")
    rows = []
    for name in args.shapes.split(","):
        (spec,) = kv_specs(name, dtype=DTYPE, page_size=PAGE_SIZE).groups
        planes, heads, width = spec.token_shape
        nbytes = spec.bytes_per_token * args.tokens
        row = {"model_shape": name, "layers": len(spec.layers), "planes": planes, "heads": heads, "width": width}
        row["kv_bytes"] = nbytes
        for mode in MODES:
            seconds, setup_s = measure(mode, name, args.tokens, args.runs, args.device)
            median = statistics.median(seconds)
            row[f"{mode}_s"] = round(median, 5)
            row[f"{mode}_gb_s"] = round(nbytes / median / 1e9, 2)
            if setup_s is not None:
                row["pages_setup_s"] = round(setup_s, 4)
        row["pages_backend"] = "cuda_ipc" if args.device == "cuda" else "host_memory"
        row["zmq_over_pages"] = round(row["zmq_s"] / row["pages_s"], 2)
        rows.append(row)
    print(
        json.dumps(
            {
                "benchmark": "kv_handoff",
                "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
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
