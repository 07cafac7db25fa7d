"""Real worker processes (a tiny random model over SmolLM2's vocabulary, with its tokenizer, so that
grammars and text are real): a request that fails on its own ends alone and the worker serves on; a
fault of the engine as a whole gives every request in flight a clean error, and a request that
brings workers down is not sent on to bring down the rest."""

import asyncio
import json
import random

import msgspec
import pytest

from tests.waiting import wait_until
from tests.workers.faulty_worker import DETOKENIZER_FAULT, ENGINE_FAULT
from tests.workers.worker_process import CONFIG, collect, connected_client, role_options, start_worker, token_ids
from workers.client.engine_client import EngineClient
from workers.client.worker_link import RequestRejectedError
from workers.engine import SamplingParams
from workers.protocol.messages import GenerateOutput, GenerateRequest, GrammarLimits, OutputConstraintSpec

pytestmark = pytest.mark.slow

WORDS_CONFIG = {**CONFIG, "vocab_size": 49152}  # SmolLM2's vocabulary on a tiny random model
TOKENIZER = ("--tokenizer", "smollm2-135m-instruct")
MODEL = "tiny-words"
FAULTY = "tests.workers.faulty_worker"
TIMEOUT_S = 240.0
# The schema. Past admission only with the repeat limit raised; then the lexer runs out of
# fuel on the second "bb" of the string.
EXPLODING_SCHEMA = json.dumps(
    {"type": "object", "properties": {"s": {"type": "string", "pattern": "^(a|aa)*b{50000}$"}}, "required": ["s"]}
)
PAST_ADMISSION = GrammarLimits(max_regex_repeat=100_000)


def greedy(max_tokens: int, **options) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **options)


def random_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(WORDS_CONFIG["vocab_size"]) for _ in range(length)]


def bystanders(tag: str) -> list[GenerateRequest]:
    return [GenerateRequest(f"{tag}-{i}", random_prompt(8 + i, seed=i), greedy(24)) for i in range(16)]


def exploding(request_id: str, tokenizer, limits: GrammarLimits = GrammarLimits()) -> GenerateRequest:
    """Biased toward writing `{"s": "bbbb`, which a random model would not find by itself."""
    bias = {token: 100.0 for token in tokenizer.encode('{"s": "bbbb', allow_special=False)}
    constraint = OutputConstraintSpec("json", EXPLODING_SCHEMA, limits)
    return GenerateRequest(request_id, [1, 2, 3], greedy(40, logit_bias=bias), constraint=constraint)


async def outputs_or_error(
    client: EngineClient, request: GenerateRequest
) -> tuple[list[GenerateOutput], RequestRejectedError | None]:
    outputs = []
    try:
        async for output in client.generate(request):
            outputs.append(output)
    except RequestRejectedError as error:
        return outputs, error
    return outputs, None


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, TIMEOUT_S))


def start(directory, name: str, role: str = "mixed", module: str = "workers.worker"):
    options = (*role_options(directory, name, role), *TOKENIZER)
    return start_worker(directory, name, *options, config=WORDS_CONFIG, model=MODEL, module=module)


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    process = start(tmp_path_factory.mktemp("iso"), "w", module=FAULTY)
    yield process
    assert process.stop() == 0


def test_a_constraint_that_fails_mid_decode_ends_its_request_alone_beside_16_streams(worker, smollm2_tokenizer):
    async def go():
        client = await connected_client(worker.endpoints)
        try:
            started_at = client.healthy_workers()[0].started_at
            reference = await asyncio.gather(*(collect(client, r) for r in bystanders("alone")))
            streams = [asyncio.create_task(collect(client, r)) for r in bystanders("beside")]
            doomed = await outputs_or_error(client, exploding("doomed", smollm2_tokenizer, PAST_ADMISSION))
            return reference, await asyncio.gather(*streams), doomed, started_at, client.healthy_workers()
        finally:
            await client.close()

    reference, beside, (outputs, error), started_at, beats = run(go())

    assert error.kind == "invalid_constraint"
    assert error.message == "the output constraint failed: lexer error: too many expressions constructed"
    assert "".join(output.text for output in outputs) == '{"s": "bb'  # the failing token is not delivered
    assert [token_ids(stream) for stream in beside] == [token_ids(stream) for stream in reference]
    assert {stream[-1].finish_reason for stream in beside} == {"length"}
    assert worker.process.poll() is None
    assert [beat.started_at for beat in beats] == [started_at]  # the same process, never restarted


def test_a_constraint_past_the_grammar_limits_is_refused_before_any_token(worker, smollm2_tokenizer):
    async def go():
        client = await connected_client(worker.endpoints)
        try:
            return await outputs_or_error(client, exploding("refused", smollm2_tokenizer))
        finally:
            await client.close()

    outputs, error = run(go())

    assert outputs == []
    assert error.kind == "invalid_constraint"
    assert "repeats up to 50000 times; at most 1000 are allowed" in error.message


def test_a_request_whose_detokenizing_raises_fails_alone_and_the_worker_serves_on(worker):
    broken = GenerateRequest("broken", [4, 5, 6], greedy(24, stop=(DETOKENIZER_FAULT,)))

    async def go():
        client = await connected_client(worker.endpoints)
        try:
            streams = [asyncio.create_task(collect(client, r)) for r in bystanders("detok")]
            failed = await outputs_or_error(client, broken)
            return await asyncio.gather(*streams), failed
        finally:
            await client.close()

    beside, (outputs, error) = run(go())

    assert outputs == [] and error.kind == "internal"
    assert "detokenizer" not in error.message  # the details are for the worker's log
    assert all(len(token_ids(stream)) == 24 and stream[-1].finish_reason == "length" for stream in beside)
    assert worker.process.poll() is None


def test_an_engine_fault_gives_every_request_in_flight_a_worker_failed_error(tmp_path_factory):
    process = start(tmp_path_factory.mktemp("fault"), "f", module=FAULTY)
    fatal = GenerateRequest("fatal", [7, 8, 9], greedy(8, stop=(ENGINE_FAULT,)))

    async def go():
        # Heartbeats that stop would take a minute to notice: the errors must come from the worker.
        client = await connected_client(process.endpoints, heartbeat_timeout_s=60.0)
        try:
            streams = [client.generate(r) for r in bystanders("inflight")[:4]]
            for stream in streams:
                await anext(stream)  # every one is running

            async def rest(stream) -> RequestRejectedError | None:
                try:
                    async for _ in stream:
                        pass
                except RequestRejectedError as error:
                    return error

            tails = [asyncio.create_task(rest(stream)) for stream in streams]
            _, fatal_error = await outputs_or_error(client, fatal)
            return fatal_error, await asyncio.gather(*tails)
        finally:
            await client.close()

    fatal_error, errors = run(go())

    assert [error.kind for error in [fatal_error, *errors]] == ["worker_failed"] * 5
    assert process.process.wait(timeout=30) == 1


def test_a_request_that_brings_workers_down_is_retried_once_and_not_when_sent_again(tmp_path_factory):
    directory = tmp_path_factory.mktemp("poison")
    prefills = [start(directory, f"p{index}", "prefill", module=FAULTY) for index in range(4)]
    decode = start(directory, "d", "decode")
    poison = GenerateRequest("poison", [7, 8, 9], greedy(8, stop=(ENGINE_FAULT,)))

    def down() -> int:
        return sum(worker.process.poll() is not None for worker in prefills)

    async def go():
        client = await connected_client(*(worker.endpoints for worker in [*prefills, decode]))
        try:
            _, first = await outputs_or_error(client, poison)
            # A client repeating it: the same request under another id.
            _, again = await outputs_or_error(client, msgspec.structs.replace(poison, request_id="poison-again"))
            return first, again, await collect(client, GenerateRequest("fine", [1, 2], greedy(5)))
        finally:
            await client.close()

    try:
        first, again, fine = run(go())
        wait_until(lambda: down() >= 3)
    finally:
        exit_codes = [worker.stop() for worker in [*prefills, decode]]

    assert first.kind == again.kind == "worker_failed"
    # The first time it took down the worker it ran on and the one it was retried on; sent again, it
    # was a suspect already and took down only the one it ran on; the last serves on.
    assert sorted(exit_codes[:4]) == [0, 1, 1, 1] and exit_codes[4] == 0
    assert len(token_ids(fine)) == 5
