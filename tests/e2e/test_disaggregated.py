"""The disaggregated stack (`serve --prefill 2 --decode 2`, the Redis store index) through the OpenAI
SDK: greedy outputs equal a mixed worker's, and a second turn reports the first turn's cached tokens."""

import os
import time

import httpx
import pytest
import redis

from tests.e2e.conftest import MODEL, start_stack, stop_stack
from tests.e2e.test_kv_store import BLOCK_TOKENS, SYSTEM

pytestmark = pytest.mark.slow

REDIS_URL = "redis://127.0.0.1:6379/0"
QUESTIONS = ["Name a colour of the sky.", "What is two plus two?", "Say hello in French."]


def chat(stack, messages: list[dict]):
    return stack.openai().chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)


def conversation(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


@pytest.fixture
def index_url():
    prefix = f"sluice:e2e-disaggregated:{os.getpid()}"
    yield f"{REDIS_URL}?prefix={prefix}"
    client = redis.Redis.from_url(REDIS_URL)
    for key in client.scan_iter(f"{prefix}*"):
        client.delete(key)


def wait_for_workers(stack, count: int, timeout_s: float = 120.0) -> list[dict]:
    """/healthz's workers once `count` of them send heartbeats (the first one makes the stack ready)."""
    deadline = time.monotonic() + timeout_s
    while (workers := httpx.get(f"{stack.base_url}/healthz", timeout=5).json()["workers"]) and len(workers) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(workers)} of {count} workers became healthy")
        time.sleep(0.5)
    return workers


def run_turns(stack) -> tuple[list[str], object, object]:
    """Each question's answer, then a conversation's two turns."""
    answers = [chat(stack, conversation(question)).choices[0].message.content for question in QUESTIONS]
    first = chat(stack, conversation(QUESTIONS[0]))
    turn2 = [
        *conversation(QUESTIONS[0]),
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And at night?"},
    ]
    return answers, first, chat(stack, turn2)


def test_split_stack_answers_like_a_mixed_worker_and_reports_cached_tokens(tmp_path, index_url):
    split_dir, mixed_dir = tmp_path / "split", tmp_path / "mixed"
    split_dir.mkdir()
    mixed_dir.mkdir()
    process, stack = start_stack(
        split_dir,
        f"sqlite:///{split_dir / 'db.sqlite3'}",
        "tenant",
        "--prefill=2",
        "--decode=2",
        f"--kv-store-index={index_url}",
    )
    try:
        workers = wait_for_workers(stack, 4)
        answers, first, second = run_turns(stack)
    finally:
        stop_stack(process)
    process, stack = start_stack(
        mixed_dir, f"sqlite:///{mixed_dir / 'db.sqlite3'}", "tenant", "--workers=1", "--no-kv-store"
    )
    try:
        mixed_answers, _, mixed_second = run_turns(stack)
    finally:
        stop_stack(process)

    assert sorted(worker["role"] for worker in workers) == ["decode", "decode", "prefill", "prefill"]
    assert answers == mixed_answers
    assert second.choices[0].message.content == mixed_second.choices[0].message.content
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens // BLOCK_TOKENS * BLOCK_TOKENS
    assert first.usage.prompt_tokens >= BLOCK_TOKENS
