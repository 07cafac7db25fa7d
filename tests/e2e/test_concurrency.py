"""Many concurrent streams through the gateway, all complete and correct."""

import asyncio

import openai
import pytest

from tests.e2e.conftest import MODEL

pytestmark = pytest.mark.slow


def test_64_concurrent_streams_all_complete(stack):
    questions = [f"Count from {i} to {i + 3}." for i in range(64)]

    async def one(client: openai.AsyncOpenAI, question: str) -> tuple[str, str | None, int]:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": question}],
            temperature=0,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, finish, completion_tokens = "", None, 0
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                completion_tokens = chunk.usage.completion_tokens
        return text, finish, completion_tokens

    async def all_of_them() -> list[tuple[str, str | None, int]]:
        client = openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key=stack.api_key, max_retries=0, timeout=600)
        return await asyncio.gather(*(one(client, q) for q in questions))

    results = asyncio.run(all_of_them())
    assert all(finish in {"stop", "length"} for _, finish, _ in results)
    assert all(0 < tokens <= 12 for _, _, tokens in results)
    # The same question alone gives the same greedy text: batching changed nothing.
    alone = stack.openai().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": questions[17]}], temperature=0, max_tokens=12
    )
    assert results[17][0] == alone.choices[0].message.content
