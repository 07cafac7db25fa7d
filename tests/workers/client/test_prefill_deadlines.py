"""Deadlines on a split request's prefill path follow its predicted prefill time: the rules, the
decode worker's wait, and an 8,000-token prompt that is prefilled once on real worker processes."""

import asyncio
import random
import time

import pytest
import zmq

from tests.workers.worker_process import (
    CONFIG,
    collect,
    connected_client,
    role_options,
    start_worker,
    token_ids,
    wait_for_heartbeat,
)
from workers.client.prefill_deadlines import (
    CONSERVATIVE_PREFILL_S_PER_TOKEN,
    DEADLINE_FACTOR,
    DEADLINE_SLACK_S,
    TRANSFER_SLACK_S,
    DeadlineModel,
)
from workers.cost_model import PrefillCostModel
from workers.engine import SamplingParams
from workers.protocol.messages import GenerateRequest
from workers.transfer.link import TransferReceiver

LINEAR = PrefillCostModel(a=0.0, b=0.01, d=0.0, e=0.0)  # 10 ms per token, whatever the chunk


def test_the_waits_follow_the_predicted_prefill_of_the_uncached_tokens():
    model = DeadlineModel(LINEAR)

    deadlines = model.deadlines(prompt_tokens=8000, cached_tokens=0, queued_tokens=0, prediction_error=0.0)

    assert deadlines.first_output_s == DEADLINE_SLACK_S + DEADLINE_FACTOR * 80.0
    assert deadlines.transfer_s == TRANSFER_SLACK_S + DEADLINE_FACTOR * 80.0
    assert deadlines.handoff_s == deadlines.first_output_s + deadlines.transfer_s


def test_cached_tokens_shorten_the_waits_and_a_queue_ahead_lengthens_the_first():
    model = DeadlineModel(LINEAR)
    alone = model.deadlines(prompt_tokens=8000, cached_tokens=0, queued_tokens=0, prediction_error=0.0)

    cached = model.deadlines(prompt_tokens=8000, cached_tokens=6000, queued_tokens=0, prediction_error=0.0)
    queued = model.deadlines(prompt_tokens=8000, cached_tokens=0, queued_tokens=3000, prediction_error=0.0)

    assert cached.first_output_s == DEADLINE_SLACK_S + DEADLINE_FACTOR * 20.0
    assert queued.first_output_s == alone.first_output_s + DEADLINE_FACTOR * 30.0
    assert queued.transfer_s == alone.transfer_s  # the queue is behind it by then


def test_the_prefill_workers_recent_prediction_error_widens_the_margin():
    model = DeadlineModel(LINEAR)

    deadlines = model.deadlines(prompt_tokens=1000, cached_tokens=0, queued_tokens=0, prediction_error=0.5)

    assert deadlines.first_output_s == DEADLINE_SLACK_S + DEADLINE_FACTOR * 1.5 * 10.0


def test_the_prediction_is_the_cost_models_chunked_by_the_step_budget():
    quadratic = PrefillCostModel(a=0.05, b=1e-3, d=1e-6, e=2e-6)
    model = DeadlineModel(quadratic, step_budget_s=0.5, chunk_limit=512)

    assert model.predicted_s(4000, 1000) == quadratic.predict_prefill(4000, 1000, 0.5, limit=512)


def test_without_a_fitted_model_a_conservative_rate_per_token_predicts():
    model = DeadlineModel(None)

    deadlines = model.deadlines(prompt_tokens=8000, cached_tokens=0, queued_tokens=0, prediction_error=0.0)

    assert model.predicted_s(8000) == 8000 * CONSERVATIVE_PREFILL_S_PER_TOKEN
    assert deadlines.first_output_s == DEADLINE_SLACK_S + DEADLINE_FACTOR * 8000 * CONSERVATIVE_PREFILL_S_PER_TOKEN


def test_a_prompt_wholly_cached_waits_only_the_slack():
    deadlines = DeadlineModel(LINEAR).deadlines(
        prompt_tokens=500, cached_tokens=500, queued_tokens=0, prediction_error=0.0
    )

    assert (deadlines.first_output_s, deadlines.transfer_s) == (DEADLINE_SLACK_S, TRANSFER_SLACK_S)


def test_an_expectation_waits_for_its_own_timeout_and_else_for_the_default():
    with zmq.Context() as context, context.socket(zmq.ROUTER) as router:
        receiver = TransferReceiver(router, default_timeout_s=2.0)
        receiver.expect("own", b"peer", None, 50.0)
        receiver.expect("default", b"peer", None)
        now = time.monotonic()

        assert receiver.expired(now + 1.0) == []
        late = receiver.expired(now + 10.0)
        assert [(r.request_id, r.error) for r in late] == [("default", "no KV arrived within 2 s")]
        late = receiver.expired(now + 60.0)
        assert [(r.request_id, r.error) for r in late] == [("own", "no KV arrived within 50 s")]


LONG_CONFIG = {**CONFIG, "max_position_embeddings": 8192}
PROMPT_TOKENS = 8000


@pytest.mark.slow
@pytest.mark.parametrize("cost_model", [LINEAR, None], ids=["fitted", "conservative"])
def test_an_8000_token_prompt_is_prefilled_once_however_short_the_workers_default_wait(tmp_path_factory, cost_model):
    # given: a decode worker whose own wait (0.2 s) is far shorter than this prefill takes (about a
    # second on a tiny model), and a gateway whose deadline model predicts 80 s (or 400 s) for it
    directory = tmp_path_factory.mktemp("long")
    prefill = start_worker(directory, "p", *role_options(directory, "p", "prefill"), config=LONG_CONFIG, model="long")
    decode = start_worker(
        directory,
        "d",
        *role_options(directory, "d", "decode"),
        "--transfer-timeout",
        "0.2",
        config=LONG_CONFIG,
        model="long",
    )
    prompt = [random.Random(8).randrange(CONFIG["vocab_size"]) for _ in range(PROMPT_TOKENS)]
    request = GenerateRequest("long", prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))

    async def go():
        client = await connected_client(prefill.endpoints, decode.endpoints, deadline_model=DeadlineModel(cost_model))
        try:
            outputs = await collect(client, request)
            ended = time.time()
            beats = await wait_for_heartbeat(client, lambda beats: all(beat.sent_at > ended for beat in beats))
            return outputs, {beat.worker_id: beat for beat in beats}
        finally:
            await client.close()

    try:
        outputs, beats = asyncio.run(asyncio.wait_for(go(), 300))
    finally:
        assert [prefill.stop(), decode.stop()] == [0, 0]

    # then: one prefill of the prompt, on the prefill worker, and the decode worker continued it (a
    # decode worker that gave up waiting would have made it run again: split, or whole on itself)
    assert {name: beat.num_prompt_tokens for name, beat in beats.items()} == {"p": PROMPT_TOKENS, "d": 0}
    assert len(token_ids(outputs)) == 6 and outputs[-1].finish_reason == "length"
