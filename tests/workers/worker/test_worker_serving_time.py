"""Where a split request's time went, as a prefill and a decode worker (real processes) report it: the
phases each timed, on its last output; its KV handoff over ZMQ, counted on both sides; and the steps
each engine ran, in its heartbeats."""

import asyncio
import random
import time

import pytest

from tests.workers.worker_process import (
    CONFIG,
    collect,
    connected_client,
    role_options,
    start_worker,
    wait_for_heartbeat,
)
from workers.engine import SamplingParams
from workers.protocol.messages import GenerateRequest

MODEL = "tiny"  # both workers serve this name, so the prefill worker's KV fits the decode worker
PROMPT = [random.Random(3).randrange(CONFIG["vocab_size"]) for _ in range(40)]
MAX_TOKENS = 6
HEAD_DIM = CONFIG["hidden_size"] // CONFIG["num_attention_heads"]
# Every layer's key and value for a token, in float32: frames carry the prompt's tokens, pages
# copied in shared memory the prompt's whole pages (16 tokens each).
TOKEN_BYTES = CONFIG["num_hidden_layers"] * 2 * CONFIG["num_key_value_heads"] * HEAD_DIM * 4
HANDOFF_BYTES = {"zmq": len(PROMPT) * TOKEN_BYTES, "host_memory": -(-len(PROMPT) // 16) * 16 * TOKEN_BYTES}


@pytest.mark.parametrize("kv_transfer, backend", [("zmq", "zmq"), ("auto", "host_memory")])
def test_a_split_request_reports_its_phases_its_handoff_and_the_steps_on_each_side(tmp_path, kv_transfer, backend):
    option = f"--kv-transfer={kv_transfer}"
    prefill = start_worker(tmp_path, "p", *role_options(tmp_path, "p", "prefill"), option, model=MODEL)
    decode = start_worker(tmp_path, "d", *role_options(tmp_path, "d", "decode"), option, model=MODEL)

    async def go():
        client = await connected_client(prefill.endpoints, decode.endpoints)
        try:
            params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
            outputs = await collect(client, GenerateRequest("r", PROMPT, params))
            collected_at = time.time()
            # Heartbeats sent since every step ran, and once each side is done with the handoff.
            beats = await wait_for_heartbeat(
                client,
                lambda beats: all(
                    b.sent_at > collected_at
                    and sum(side[backend].num_transfers for side in (b.handoff_sent, b.handoff_received) if side) == 1
                    for b in beats
                ),
            )
            return outputs, {beat.worker_id: beat for beat in beats}
        finally:
            await client.close()

    try:
        outputs, beats = asyncio.run(asyncio.wait_for(go(), 120))
    finally:
        assert [prefill.stop(), decode.stop()] == [0, 0]

    # The prefill worker's output (its first token) timed the queue and the prefill, the decode
    # worker's last output the decode.
    timed = [output.phase_times for output in outputs if output.phase_times is not None]
    assert len(timed) == 2
    from_prefill, from_decode = timed
    assert from_prefill.queue_s >= 0.0 and from_prefill.prefill_s >= 0.0 and from_prefill.decode_s is None
    assert from_decode.queue_s is None and from_decode.prefill_s is None and from_decode.decode_s >= 0.0
    assert outputs[-1].phase_times is from_decode

    sent, received = beats["p"].handoff_sent[backend], beats["d"].handoff_received[backend]
    assert (sent.num_transfers, sent.num_bytes) == (1, HANDOFF_BYTES[backend])
    assert (received.num_transfers, received.num_bytes) == (1, HANDOFF_BYTES[backend])
    assert sent.seconds >= 0.0 and received.seconds >= 0.0
    assert beats["p"].handoff_received == {} and beats["d"].handoff_sent == {}

    # The prefill worker ran the prompt; the decode worker one step per token after the first.
    assert beats["p"].step_tokens.total == len(PROMPT)
    assert beats["d"].step_tokens.total == MAX_TOKENS - 1
    assert sum(beats["d"].step_seconds.counts) == sum(beats["d"].step_tokens.counts) == MAX_TOKENS - 1
    assert beats["p"].num_store_fetches == beats["d"].num_store_fetches == 0  # no KV store
