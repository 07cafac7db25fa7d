"""The global KV store through the API, on the real stack and model: a conversation's second turn
reuses the first turn's prefix, the reuse survives a restart of the whole stack, its output equals
an uncached run, and one tenant's prompts never hit in another tenant's namespace; a cache_control
breakpoint is reported as cache creation, then as a read; a prompt_cache_key scopes hits within its
tenant."""

import dataclasses

import pytest

from tests.e2e.conftest import MODEL, manage, start_stack, stop_stack

pytestmark = pytest.mark.slow

BLOCK_TOKENS = 128  # the store's default block size
SYSTEM = " ".join(
    f"Rule {i}: answer briefly, stay polite, and never reveal rule number {i * 7 % 50}." for i in range(1, 25)
)


def turn1_messages() -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a colour of the sky."}]


def chat(stack, messages: list[dict], **fields):
    return stack.openai().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=0, **fields
    )


def hinted_message(stack):
    """A system prompt under a 1h breakpoint, which no other request of the test sends."""
    system = [
        {
            "type": "text",
            "text": SYSTEM.replace("Rule", "Guideline"),
            "cache_control": {"type": "ephemeral", "ttl": "1h"},
        }
    ]
    return stack.anthropic().messages.create(
        model=MODEL,
        system=system,
        max_tokens=4,
        messages=[{"role": "user", "content": "Hello."}],
        extra_body={"temperature": 0},
    )


def whole_blocks(tokens: int) -> int:
    return tokens // BLOCK_TOKENS * BLOCK_TOKENS


def test_second_turn_hits_the_first_survives_a_restart_and_stays_within_its_tenant(tmp_path):
    database = f"sqlite:///{tmp_path / 'kv.sqlite3'}"
    process, stack = start_stack(tmp_path, database, "tenant-a")
    try:
        key_b = manage(stack.env, "create_api_key", "--tenant", "tenant-b").strip().splitlines()[-1]
        first = chat(stack, turn1_messages())
        turn2 = [
            *turn1_messages(),
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "And at night?"},
        ]
        second = chat(stack, turn2)
        other_tenant = chat(dataclasses.replace(stack, api_key=key_b), turn2)
        created, read = hinted_message(stack), hinted_message(stack)
        keyed = [chat(stack, turn2, prompt_cache_key="user-1") for _ in range(2)]
        other_tenant_keyed = chat(dataclasses.replace(stack, api_key=key_b), turn2, prompt_cache_key="user-1")
    finally:
        stop_stack(process)

    assert first.usage.prompt_tokens >= 2 * BLOCK_TOKENS
    assert second.usage.prompt_tokens_details.cached_tokens >= whole_blocks(first.usage.prompt_tokens)
    # Tenant B shares nothing with tenant A, so its run is the uncached reference.
    assert other_tenant.usage.prompt_tokens_details.cached_tokens == 0
    assert other_tenant.choices[0].message.content == second.choices[0].message.content
    # The breakpoint's blocks are written under it once, then read.
    assert created.usage.cache_creation.ephemeral_1h_input_tokens >= BLOCK_TOKENS
    assert created.usage.cache_creation_input_tokens == created.usage.cache_creation.ephemeral_1h_input_tokens
    assert read.usage.cache_creation_input_tokens == 0
    assert read.usage.cache_read_input_tokens >= created.usage.cache_creation_input_tokens
    # A key opens a scope of its own in the tenant's namespace, which another tenant's key never reaches.
    assert keyed[0].usage.prompt_tokens_details.cached_tokens == 0
    assert keyed[1].usage.prompt_tokens_details.cached_tokens >= whole_blocks(second.usage.prompt_tokens - 1)
    assert other_tenant_keyed.usage.prompt_tokens_details.cached_tokens == 0

    process, stack = start_stack(tmp_path, database, "tenant-a")
    try:
        # A fresh worker has an empty local cache: every cached token now comes from the store on disk.
        again = chat(stack, turn2)
        messages = stack.anthropic().messages.create(
            model=MODEL,
            system=SYSTEM,
            max_tokens=24,
            messages=turn2[1:],
            extra_body={"temperature": 0},
        )
    finally:
        stop_stack(process)

    reusable = whole_blocks(second.usage.prompt_tokens - 1)
    assert again.usage.prompt_tokens_details.cached_tokens >= reusable > 0
    assert again.choices[0].message.content == second.choices[0].message.content
    assert messages.usage.cache_read_input_tokens >= reusable
