import msgspec

from workers.client.crash_suspects import CrashSuspects, leaves_another
from workers.engine import SamplingParams
from workers.protocol.messages import GenerateRequest, OutputConstraintSpec

REQUEST = GenerateRequest("a", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4))


def test_the_same_request_under_another_id_is_a_suspect_once_recorded():
    suspects = CrashSuspects()
    again = msgspec.structs.replace(REQUEST, request_id="b")
    assert suspects.suspected(again) is False

    suspects.record(REQUEST)

    assert suspects.suspected(again) is True


def test_other_work_is_not_a_suspect():
    suspects = CrashSuspects()
    suspects.record(REQUEST)

    others = [
        msgspec.structs.replace(REQUEST, prompt_token_ids=[1, 2, 4]),
        msgspec.structs.replace(REQUEST, params=SamplingParams(temperature=0.0, max_tokens=5)),
        msgspec.structs.replace(REQUEST, constraint=OutputConstraintSpec("regex", "a+")),
    ]

    assert [suspects.suspected(other) for other in others] == [False, False, False]


def test_the_oldest_suspects_are_forgotten_first():
    suspects = CrashSuspects(max_suspects=2)
    first, second, third = (msgspec.structs.replace(REQUEST, prompt_token_ids=[n]) for n in (1, 2, 3))
    for request in (first, second, third):
        suspects.record(request)

    assert [suspects.suspected(request) for request in (first, second, third)] == [False, True, True]


def test_a_suspect_may_run_on_a_worker_only_while_another_is_ready_besides():
    last, other = object(), object()

    assert leaves_another([last, other], last) is True
    assert leaves_another([last], last) is False
    assert leaves_another([], last) is False
