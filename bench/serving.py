"""Serving latency: the same requests through the HTTP gateway, straight to the worker over ZMQ, and
through the offline engine in this process, in one run.

    python -m bench.serving [--concurrency 32] [--requests 64] [--max-tokens 32] [--model M] [--device cuda]

Starts one worker (`python -m workers.worker`) and one gateway (uvicorn) on this machine, with a
throw-away SQLite database and API key. Each path runs the same prompts with the same concurrency
(a closed loop of `concurrency` clients), with prefix caching off everywhere so that no path profits
from the prompts an earlier one computed. TTFT is measured from sending a request to its first
token, inter-token latency between a stream's tokens. The gateway's added latency comes from a third,
paired run in which alternate requests go through the gateway and straight to the worker, so both
kinds share the same engine steps: its median TTFT through the gateway minus that over ZMQ. (Runs of
a single path each set their own batching rhythm, so their TTFTs differ by far more than the gateway
adds.) Prints one JSON object, with the CPU seconds each process used per path.
"""

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch

from workers.args import EngineArgs
from workers.client.engine_client import EngineClient
from workers.engine import SamplingParams
from workers.engine.builder import engine_config
from workers.engine.engine import LLMEngine
from workers.engine.model_loader import load_model
from workers.protocol.engine_request import EngineRequest
from workers.protocol.messages import GenerateRequest

ROOT = Path(__file__).resolve().parents[1]
# The served model and the device of the worker and the offline engine: --model and --device.
MODEL = "smollm2-135m-instruct"
DEVICE = "cpu"
SERVED_NAME = MODEL  # what the gateway lists it as: a directory's name


@dataclass
class Timing:
    ttft: float
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    path: str = ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--model", default=MODEL, help="a packaged model name or a model directory")
    parser.add_argument("--device", default=DEVICE)
    args = parser.parse_args()
    _use(args.model, args.device)
    questions = [f"Question {i}: name one animal that lives in the sea, and say why." for i in range(args.requests)]

    with tempfile.TemporaryDirectory(prefix="sluice-bench-") as scratch:
        stack = _Stack(Path(scratch))
        try:
            stack.start()
            prompts = _prompts(stack, questions)
            params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
            before = stack.cpu_seconds()
            rows = {
                "gateway_http": _run(
                    _via_gateway(stack, questions, args.max_tokens), None, len(prompts), args.concurrency
                )
            }
            middle = stack.cpu_seconds()
            rows["worker_zmq"] = _run(*_via_worker(stack, prompts, params), len(prompts), args.concurrency)
            after = stack.cpu_seconds()
            cpu = {
                "gateway_http": {name: round(middle[name] - before[name], 2) for name in before},
                "worker_zmq": {name: round(after[name] - middle[name], 2) for name in before},
            }
            paired, _ = _run(*_paired(stack, questions, prompts, params), len(prompts), args.concurrency)
        finally:
            stack.stop()
    rows["offline_engine"] = _offline(prompts, params, args.concurrency)
    summary = {name: _summarise(timings, elapsed) for name, (timings, elapsed) in rows.items()}
    for name, seconds in cpu.items():
        summary[name]["cpu_s"] = seconds
    by_path = {path: _summarise([t for t in paired if t.path == path], 1.0) for path in ("gateway_http", "worker_zmq")}
    paired_summary = {path: {key: row[key] for key in ("ttft_ms", "itl_ms")} for path, row in by_path.items()}
    added = by_path["gateway_http"]["ttft_ms"]["p50"] - by_path["worker_zmq"]["ttft_ms"]["p50"]
    print(
        json.dumps(
            {
                "benchmark": "serving",
                "model": MODEL,
                "concurrency": args.concurrency,
                "requests": args.requests,
                "max_tokens": args.max_tokens,
                "paths": summary,
                "paired": paired_summary,
                "gateway_added_p50_ttft_ms": round(added, 2),
            },
            indent=2,
        )
    )


class _Stack:
    """One worker and one gateway on a throw-away SQLite database."""

    def __init__(self, scratch: Path) -> None:
        self.scratch = scratch
        self.requests = f"ipc://{scratch}/worker.requests"
        self.heartbeats = f"ipc://{scratch}/worker.heartbeats"
        self.port = _free_port()
        self.env = dict(
            os.environ,
            DATABASE_URL=f"sqlite:///{scratch}/db.sqlite3",
            SLUICE_VAR_DIR=str(scratch),
            SLUICE_MODELS=MODEL,
            SLUICE_WORKER_ENDPOINTS=f"{self.requests}|{self.heartbeats}",
        )
        self.processes: list[subprocess.Popen] = []
        self.api_key = ""

    def start(self) -> None:
        manage = [sys.executable, str(ROOT / "manage.py")]
        subprocess.run([*manage, "migrate", "--no-input"], env=self.env, check=True, capture_output=True)
        created = subprocess.run(
            [*manage, "create_api_key", "--tenant", "bench"], env=self.env, check=True, capture_output=True, text=True
        )
        self.api_key = created.stdout.strip().splitlines()[-1]
        self._spawn([sys.executable, "-m", "workers.worker", f"--model={MODEL}", f"--device={DEVICE}",
                     "--no-prefix-caching",
                     f"--request-endpoint={self.requests}", f"--heartbeat-endpoint={self.heartbeats}"])  # fmt: skip
        self._spawn([sys.executable, "-m", "uvicorn", "controlplane.asgi:application", f"--port={self.port}",
                     "--log-level=warning", "--no-access-log"])  # fmt: skip
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError("the gateway or worker did not become healthy")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time used so far by the worker, the gateway and this process (the benchmark client)."""
        ticks = os.sysconf("SC_CLK_TCK")
        used = {}
        for name, process in zip(("worker", "gateway"), self.processes, strict=True):
            fields = Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()
            used[name] = (int(fields[11]) + int(fields[12])) / ticks  # utime + stime
        times = os.times()
        used["client"] = times.user + times.system
        return used

    def _spawn(self, argv: list[str]) -> None:
        log = open(self.scratch / f"{len(self.processes)}.log", "w")
        self.processes.append(subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT))

    def stop(self) -> None:
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            process.wait(timeout=30)


def _use(model: str, device: str) -> None:
    from workers.engine.weights import resolve_model

    global MODEL, DEVICE, SERVED_NAME
    MODEL, DEVICE, SERVED_NAME = model, device, resolve_model(model, progress=False).name


def _prompts(stack: _Stack, questions: list[str]) -> list[list[int]]:
    """The prompt token ids the gateway itself makes of each question (Completions echo counts them)."""
    from workers.engine.weights import resolve_model
    from workers.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_model_files(resolve_model(MODEL))
    return [
        tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}]), allow_special=True)
        for q in questions
    ]


def _via_gateway(
    stack: _Stack, questions: list[str], max_tokens: int
) -> Callable[[httpx.AsyncClient, int], Awaitable[Timing]]:
    async def one(client: httpx.AsyncClient, index: int) -> Timing:
        body = {
            "model": SERVED_NAME,
            "messages": [{"role": "user", "content": questions[index]}],
            "temperature": 0,
            "max_tokens": max_tokens,
            "ignore_eos": True,  # as on the other paths: every request generates max_tokens
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        started = time.perf_counter()
        timing, last = None, started
        async with client.stream("POST", f"{stack.url}/v1/chat/completions", json=body,
                                 headers={"Authorization": f"Bearer {stack.api_key}"}) as response:  # fmt: skip
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    timing.tokens = chunk["usage"]["completion_tokens"]
                choices = chunk.get("choices") or [{}]
                if not choices[0].get("delta", {}).get("content"):
                    continue
                # A delta may hold several tokens (text waits for whole UTF-8 characters): gaps are
                # between deltas, and the token count comes from the usage chunk.
                now = time.perf_counter()
                if timing is None:
                    timing = Timing(ttft=now - started)
                else:
                    timing.gaps.append(now - last)
                last = now
        return timing

    return one


def _via_worker(stack: _Stack, prompts: list[list[int]], params: SamplingParams) -> tuple[Callable, Callable]:
    """The request function, and the client's close (run in the same event loop)."""
    engine_client = EngineClient()
    engine_client.add_worker(stack.requests, stack.heartbeats)

    async def one(_: object, index: int) -> Timing:
        if not engine_client.healthy_workers():
            await engine_client.start()
            while not engine_client.healthy_workers():
                await asyncio.sleep(0.05)
        started = time.perf_counter()
        timing, last = None, started
        request = GenerateRequest(request_id=f"bench-{index}-{time.monotonic_ns()}", prompt_token_ids=prompts[index],
                                  params=params)  # fmt: skip
        async for output in engine_client.generate(request):
            now = time.perf_counter()
            if not output.token_ids:
                continue
            if timing is None:
                timing = Timing(ttft=now - started)
            else:
                timing.gaps.append(now - last)
            timing.tokens += len(output.token_ids)
            last = now
        return timing

    return one, engine_client.close


def _paired(
    stack: _Stack, questions: list[str], prompts: list[list[int]], params: SamplingParams
) -> tuple[Callable, Callable]:
    """Even requests through the gateway, odd ones straight to the worker, in one closed loop: both
    kinds share the same engine steps, so their TTFTs differ by what the gateway adds."""
    through_gateway = _via_gateway(stack, questions, params.max_tokens)
    through_worker, close = _via_worker(stack, prompts, params)

    async def one(http: httpx.AsyncClient, index: int) -> Timing:
        path = "gateway_http" if index % 2 == 0 else "worker_zmq"
        timing = await (through_gateway if index % 2 == 0 else through_worker)(http, index)
        timing.path = path
        return timing

    return one, close


def _run(
    one: Callable, close: Callable[[], Awaitable[None]] | None, count: int, concurrency: int
) -> tuple[list[Timing], float]:
    async def clients() -> tuple[list[Timing], float]:
        queue: asyncio.Queue[int] = asyncio.Queue()
        for index in range(count):
            queue.put_nowait(index)
        timings: list[Timing] = []

        async def client_loop(http: httpx.AsyncClient) -> None:
            while not queue.empty():
                timings.append(await one(http, queue.get_nowait()))

        async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency)) as http:
            try:
                await one(http, 0)  # warm-up: connections, the engine client, first-request paths
                started = time.perf_counter()
                await asyncio.gather(*(client_loop(http) for _ in range(concurrency)))
                return timings, time.perf_counter() - started
            finally:
                if close is not None:
                    await close()

    return asyncio.run(clients())


def _offline(prompts: list[list[int]], params: SamplingParams, concurrency: int) -> tuple[list[Timing], float]:
    """The same closed loop against an engine in this process: no sockets, no HTTP."""
    loaded = load_model(MODEL, device=torch.device(DEVICE), dtype=None, seed=0, max_model_len=None)
    engine = LLMEngine(loaded, engine_config(EngineArgs(model=MODEL, device=DEVICE, enable_prefix_caching=False)))
    pending = list(range(len(prompts)))
    sent: dict[str, float] = {}
    last: dict[str, float] = {}
    timings: dict[str, Timing] = {}
    started = time.perf_counter()

    def admit() -> None:
        index = pending.pop(0)
        request_id = f"offline-{index}"
        engine.add_request(EngineRequest(request_id=request_id, prompt_token_ids=prompts[index], params=params))
        sent[request_id] = time.perf_counter()

    for _ in range(min(concurrency, len(pending))):
        admit()
    while engine.has_unfinished():
        for delta in engine.step():
            now = time.perf_counter()
            if delta.request_id not in timings:
                timings[delta.request_id] = Timing(ttft=now - sent[delta.request_id])
            else:
                timings[delta.request_id].gaps.append(now - last[delta.request_id])
            timings[delta.request_id].tokens += len(delta.token_ids)
            last[delta.request_id] = now
            if delta.finished and pending:
                admit()
    return list(timings.values()), time.perf_counter() - started


def _summarise(timings: list[Timing], elapsed: float) -> dict:
    def percentiles(values: list[float]) -> dict[str, float]:
        ordered = sorted(values)
        return {
            "p50": round(statistics.median(ordered) * 1000, 2),
            "p99": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1000, 2),
        }

    tokens = sum(t.tokens for t in timings)
    return {
        "ttft_ms": percentiles([t.ttft for t in timings]),
        "itl_ms": percentiles([g for t in timings for g in t.gaps]),
        "output_tokens_per_s": round(tokens / elapsed, 1),
        "requests_per_s": round(len(timings) / elapsed, 2),
    }


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


if __name__ == "__main__":
    main()
