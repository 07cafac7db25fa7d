"""Tenant fairness: tenant B's time to first token alone and under a flood from tenant A, with fair
admission on and off, in one run.

    python -m bench.fairness [--b-requests 30] [--b-interval-s 0.8] [--flood 64] [--max-num-batched-tokens 48]

Starts one worker with the real SmolLM2 (CPU, prefix caching off: every prompt is computed) and two
gateways in front of it on one throw-away SQLite database: one with fair admission (the default),
one with SLUICE_FAIR_ADMISSION=0 (no caps, every queue in arrival order). Tenant B sends short chats
(`--b-requests`, one every `--b-interval-s`, each timed from sending to its first content token,
after a few untimed ones that warm up each gateway, before the flood);
tenant A keeps `--flood` long prompts in flight from as many clients, each sending its next as soon
as one is answered (after retry-after when refused with 429, as a client that retries would). Each
gateway runs B alone, then B under A's flood (B starts once the worker has A's requests waiting; the
flood goes on until B's last request is answered). With fair admission on, A's caps are the
gateway's defaults (128 requests in flight, 65,536 queued prompt tokens, so all 64 get in); both
tenants' rate limits are lifted, so that only fair admission limits A. Prints one JSON object: B's
TTFT percentiles per case, and the ratio of B's p99 under the flood to B's p99 alone.

The worker's prefill chunk (`--max-num-batched-tokens`) is about the size of B's prompt: steps are
not preemptible, so B's first token under load waits for the step in progress and then its own,
while alone it waits for its own only; on a CPU, where a step's time grows with its tokens, the ratio
can come within 2x only when a step is not much longer than B's own prefill.
"""

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"
WORDS = "river stone cloud market lantern orchard signal copper meadow harbor winter garden".split()
FLOOD_WARM_WAITING = 16  # A's requests waiting in the worker before B starts
WARM_UP_REQUESTS = 5  # B's untimed requests through each gateway before B alone


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--b-requests", type=int, default=30)
    # B's prompts then take about a fifth of the worker's prefill (~280 tokens/s on 2 shared cores),
    # well within B's fair half under the flood: a tenant that sends more than its share gets its
    # share, and its requests queue behind its own.
    parser.add_argument("--b-interval-s", type=float, default=0.8)
    parser.add_argument("--flood", type=int, default=64, help="tenant A's clients, each with one request at a time")
    parser.add_argument("--flood-prompt-words", type=int, default=120)
    parser.add_argument("--max-num-batched-tokens", type=int, default=48)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="sluice-fairness-") as scratch:
        stack = _Stack(Path(scratch), args.max_num_batched_tokens)
        try:
            stack.start()
            tokens = {
                "a": stack.prompt_tokens(a_messages(0, args.flood_prompt_words)),
                "b": stack.prompt_tokens(b_messages(0)),
            }
            cases = {}
            for mode, url in stack.gateways.items():
                alone = asyncio.run(_b_alone(stack, url, args))
                _progress(f"fair admission {mode}: B alone done")
                flooded, flood = asyncio.run(_b_under_flood(stack, url, args))
                _progress(f"fair admission {mode}: B under the flood done")
                cases[mode] = {
                    "b_alone_ttft_ms": _percentiles(alone),
                    "b_under_flood_ttft_ms": _percentiles(flooded),
                    "p99_ratio": round(_p99(flooded) / _p99(alone), 2),
                    "a_flood": flood,
                }
        finally:
            stack.stop()
    print(
        json.dumps(
            {
                "benchmark": "fairness",
                "model": MODEL,
                "device": "cpu",
                "worker": {"max_num_batched_tokens": args.max_num_batched_tokens, "prefix_caching": False},
                "b": {"requests": args.b_requests, "interval_s": args.b_interval_s, "prompt_tokens": tokens["b"]},
                "a": {"clients": args.flood, "prompt_tokens": tokens["a"], "max_tokens": 1},
                "fair_admission_on": cases["on"],
                "fair_admission_off": cases["off"],
                "target_p99_within_2x": cases["on"]["p99_ratio"] <= 2.0,
            },
            indent=2,
        )
    )


class _Stack:
    """One worker and two gateways (fair admission on and off) on a throw-away SQLite database."""

    def __init__(self, scratch: Path, max_num_batched_tokens: int) -> None:
        self.scratch = scratch
        self.max_num_batched_tokens = max_num_batched_tokens
        self.requests = f"ipc://{scratch}/worker.requests"
        self.heartbeats = f"ipc://{scratch}/worker.heartbeats"
        self.env = dict(
            os.environ,
            DATABASE_URL=f"sqlite:///{scratch}/db.sqlite3",
            SLUICE_VAR_DIR=str(scratch),
            SLUICE_MODELS=MODEL,
            SLUICE_WORKER_ENDPOINTS=f"{self.requests}|{self.heartbeats}",
            # Every body here is small: they are prepared in the gateway's threads.
            SLUICE_PREPARE_PROCESSES="1",
            OMP_NUM_THREADS="1",
        )
        self.processes: list[subprocess.Popen] = []
        self.gateways: dict[str, str] = {}
        self.keys: dict[str, str] = {}

    def start(self) -> None:
        manage = [sys.executable, str(ROOT / "manage.py")]
        subprocess.run([*manage, "migrate", "--no-input"], env=self.env, check=True, capture_output=True)
        for tenant in ("a", "b"):
            command = [*manage, "create_api_key", "--tenant", tenant]
            created = subprocess.run(command, env=self.env, check=True, capture_output=True, text=True)
            self.keys[tenant] = created.stdout.strip().splitlines()[-1]
        # Rate limits out of the way: A is limited by fair admission alone (a refused request counts
        # against the rate limit too, so A's retries would otherwise throttle A's flood for it).
        unlimited = "from controlplane.tenants.models import Tenant; Tenant.objects.update(rate_limit_rpm=10**6)"
        subprocess.run([*manage, "shell", "-c", unlimited], env=self.env, check=True, capture_output=True)
        self._spawn([sys.executable, "-m", "workers.worker", f"--model={MODEL}", "--no-prefix-caching",
                     f"--max-num-batched-tokens={self.max_num_batched_tokens}",
                     f"--request-endpoint={self.requests}", f"--heartbeat-endpoint={self.heartbeats}"], {})  # fmt: skip
        for mode, flag in (("on", "1"), ("off", "0")):
            port = _free_port()
            self._spawn([sys.executable, "-m", "uvicorn", "controlplane.asgi:application", f"--port={port}",
                         "--log-level=warning", "--no-access-log"], {"SLUICE_FAIR_ADMISSION": flag})  # fmt: skip
            self.gateways[mode] = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240
        for url in self.gateways.values():
            while not _healthy(url):
                if time.monotonic() > deadline:
                    raise TimeoutError("the gateways or the worker did not become healthy")
                time.sleep(0.5)
        _progress("stack ready")

    def prompt_tokens(self, messages: list[dict]) -> int:
        body = {"model": MODEL, "messages": messages}
        counted = httpx.post(f"{self.gateways['on']}/v1/messages/count_tokens", json=body,
                             headers={"x-api-key": self.keys["b"]})  # fmt: skip
        return counted.json()["input_tokens"]

    def _spawn(self, argv: list[str], env: dict[str, str]) -> None:
        log = open(self.scratch / f"{len(self.processes)}.log", "w")
        process = subprocess.Popen(argv, env={**self.env, **env}, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        self.processes.append(process)

    def stop(self) -> None:
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            process.wait(timeout=30)


def a_messages(index: int, words: int) -> list[dict]:
    rng = random.Random(index)
    text = " ".join(rng.choice(WORDS) for _ in range(words))
    return [{"role": "user", "content": f"Document {index}: {text}. Summarise it."}]


def b_messages(index: int) -> list[dict]:
    return [{"role": "user", "content": f"Question {index}: name one animal that lives in the sea."}]


async def _b_requests(url: str, key: str, args: argparse.Namespace, *, warm_up: bool) -> list[float]:
    """B's requests, one every interval (not waiting for the one before); their TTFTs in seconds.
    `warm_up`: first a few untimed ones, one after another."""

    async def one(client: httpx.AsyncClient, index: int) -> float:
        body = {"model": MODEL, "messages": b_messages(index), "max_tokens": 2, "temperature": 0,
                "ignore_eos": True, "stream": True}  # fmt: skip
        started = time.perf_counter()
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body,
                                 headers={"authorization": f"Bearer {key}"}) as response:  # fmt: skip
            response.raise_for_status()
            async for line in response.aiter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                    return time.perf_counter() - started
        raise RuntimeError("a response of B's ended without content")

    async with httpx.AsyncClient(timeout=600) as client:
        for index in range(-WARM_UP_REQUESTS if warm_up else 0, 0):
            await one(client, index)  # the connection, the first-request paths
        tasks = []
        for index in range(args.b_requests):
            tasks.append(asyncio.create_task(one(client, index)))
            await asyncio.sleep(args.b_interval_s)
        return list(await asyncio.gather(*tasks))


async def _b_alone(stack: _Stack, url: str, args: argparse.Namespace) -> list[float]:
    await _until_idle(url)
    return await _b_requests(url, stack.keys["b"], args, warm_up=True)


async def _b_under_flood(stack: _Stack, url: str, args: argparse.Namespace) -> tuple[list[float], dict]:
    await _until_idle(url)
    stop = asyncio.Event()
    counts = {"answered": 0, "refused_429": 0}
    next_index = iter(range(1_000_000))

    async def flood_client(client: httpx.AsyncClient) -> None:
        while not stop.is_set():
            body = {"model": MODEL, "messages": a_messages(next(next_index), args.flood_prompt_words),
                    "max_tokens": 1, "temperature": 0}  # fmt: skip
            response = await client.post(
                f"{url}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {stack.keys['a']}"}
            )
            if response.status_code == 429:
                counts["refused_429"] += 1
                await asyncio.sleep(float(response.headers.get("retry-after", 1)))
            else:
                response.raise_for_status()
                counts["answered"] += 1

    limits = httpx.Limits(max_connections=args.flood)
    async with httpx.AsyncClient(timeout=900, limits=limits) as client:
        flood = [asyncio.create_task(flood_client(client)) for _ in range(args.flood)]
        while _engine_load(url)[1] < FLOOD_WARM_WAITING:
            await asyncio.sleep(0.2)
        ttfts = await _b_requests(url, stack.keys["b"], args, warm_up=False)
        stop.set()
        for task in flood:
            task.cancel()
        await asyncio.gather(*flood, return_exceptions=True)
    return ttfts, counts


def _engine_load(url: str) -> tuple[int, int]:
    workers = httpx.get(f"{url}/healthz", timeout=30).json()["workers"]
    return sum(w["num_running"] for w in workers), sum(w["num_waiting"] for w in workers)


async def _until_idle(url: str) -> None:
    while _engine_load(url) != (0, 0):
        await asyncio.sleep(0.2)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


_started = time.monotonic()


def _progress(message: str) -> None:
    print(f"[{time.monotonic() - _started:6.1f} s] {message}", file=sys.stderr, flush=True)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[98]


def _percentiles(values: list[float]) -> dict[str, float]:
    return {
        "p50": round(statistics.median(values) * 1000, 1),
        "p99": round(_p99(values) * 1000, 1),
        "max": round(max(values) * 1000, 1),
        "n": len(values),
    }


if __name__ == "__main__":
    main()
