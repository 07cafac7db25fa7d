"""The issue's poison request against the real stack: a pathological pattern in a json_schema output
format is refused with a 400 naming its field, the worker processes stay the same, and the streams
running beside it all finish."""

import asyncio
from pathlib import Path

import openai
import pytest

from tests.e2e.conftest import MODEL

pytestmark = pytest.mark.slow

POISON_SCHEMA = {"type": "object", "properties": {"s": {"type": "string", "pattern": "^(a|aa)*b{50000}$"}}}


def worker_pids(base_url: str) -> dict[str, int]:
    """The `run_worker` children of the `serve` process listening at `base_url`: worker id → pid."""
    processes = _processes()
    port_flag = f"--port={base_url.rsplit(':', 1)[1]}".encode()
    [serve] = [pid for pid, (_, argv) in processes.items() if b"serve" in argv and port_flag in argv]
    return {
        _worker_id(argv): pid for pid, (parent, argv) in processes.items() if parent == serve and b"run_worker" in argv
    }


def _processes() -> dict[int, tuple[int, list[bytes]]]:
    """pid → (parent pid, argv) of every process still there when read."""
    processes = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        parent = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("PPid:"))
        processes[int(entry.name)] = (parent, argv)
    return processes


def _worker_id(argv: list[bytes]) -> str:
    prefix = b"--worker-id="
    return next(arg[len(prefix) :].decode() for arg in argv if arg.startswith(prefix))


def test_a_pathological_pattern_is_a_400_and_16_streams_beside_it_finish(stack):
    before = worker_pids(stack.base_url)

    async def stream(client: openai.AsyncOpenAI, index: int, started: asyncio.Event) -> tuple[str, str | None]:
        chunks = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Name {index + 2} colours."}],
            temperature=0,
            max_tokens=16,
            stream=True,
        )
        text, finish = "", None
        async for chunk in chunks:
            started.set()
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def poison(client: openai.AsyncOpenAI) -> list[openai.BadRequestError]:
        refusals = []
        with pytest.raises(openai.BadRequestError) as chat:
            await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Write the string."}],
                response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": POISON_SCHEMA}},
                max_tokens=32,
                stream=True,
            )
        refusals.append(chat.value)
        with pytest.raises(openai.BadRequestError) as responses:
            await client.responses.create(
                model=MODEL,
                input="Write the string.",
                text={"format": {"type": "json_schema", "name": "s", "schema": POISON_SCHEMA}},
                max_output_tokens=32,
            )
        refusals.append(responses.value)
        return refusals

    async def go():
        client = openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key=stack.api_key, max_retries=0, timeout=600)
        started = [asyncio.Event() for _ in range(16)]
        streams = [asyncio.create_task(stream(client, index, event)) for index, event in enumerate(started)]
        await asyncio.gather(*(event.wait() for event in started))  # all 16 are running
        refusals = await poison(client)
        return refusals, await asyncio.gather(*streams)

    refusals, results = asyncio.run(go())

    for refusal, param in zip(refusals, ["response_format", "text.format"], strict=True):
        assert refusal.status_code == 400
        assert refusal.body["param"] == param
        assert "repeats up to 50000 times" in refusal.body["message"]
    assert all(text and finish in {"stop", "length"} for text, finish in results)
    assert worker_pids(stack.base_url) == before and set(before) == {"prefill-0", "decode-0"}
