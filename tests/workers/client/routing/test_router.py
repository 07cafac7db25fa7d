"""The decode reservation: a request's KV now plus the output still expected (capped), so that a
request moving between decode workers is placed only where the KV it already holds fits."""

from workers.client.routing.router import EXPECTED_OUTPUT_TOKENS, NOMINAL_COST_MODEL, DecodeLoad, Router, expected_peak
from workers.engine import SamplingParams
from workers.protocol.messages import GenerateRequest, WorkerHeartbeat


def request(prompt_tokens: int, max_tokens: int | None) -> GenerateRequest:
    return GenerateRequest("r", [1] * prompt_tokens, SamplingParams(max_tokens=max_tokens))


def decode_worker(kv_capacity_tokens: int) -> DecodeLoad:
    beat = WorkerHeartbeat(
        worker_id="d",
        role="decode",
        model="m",
        request_endpoint="ipc://d",
        max_model_len=4096,
        num_running=0,
        num_waiting=0,
        kv_usage=0.0,
        num_free_pages=kv_capacity_tokens // 16,
        num_prompt_tokens=0,
        num_cached_prompt_tokens=0,
        num_preemptions=0,
        sent_at=0.0,
        kv_capacity_tokens=kv_capacity_tokens,
        max_num_seqs=8,
    )
    return DecodeLoad("d", beat, 0, 0)


def test_a_request_s_peak_counts_the_tokens_it_generated_and_what_is_left_of_its_budget():
    assert expected_peak(request(20, 100), 4096) == (20, 100)
    assert expected_peak(request(20, 100), 4096, 60) == (80, 40)
    # the expected output is capped, the tokens held are not
    assert expected_peak(request(20, 2000), 4096, 600) == (620, EXPECTED_OUTPUT_TOKENS)
    assert expected_peak(request(20, None), 700, 600) == (620, 80)  # the context window bounds the rest


def test_a_moving_request_is_not_placed_where_the_kv_it_holds_does_not_fit():
    router = Router(NOMINAL_COST_MODEL)
    worker = decode_worker(kv_capacity_tokens=600)
    # given a request of 20 prompt tokens and up to 2,000 new ones: fresh, it is reserved 20 + 512
    assert router.choose_decode([worker], *expected_peak(request(20, 2000), 4096)) == "d"
    # when it has generated 600 tokens and moves, then its 620 tokens of KV do not fit in 600
    assert router.choose_decode([worker], *expected_peak(request(20, 2000), 4096, 600)) is None
