import msgspec

from workers.crash_suspects import CrashSuspects
from workers.engine import SamplingParams
from workers.protocol import GenerateRequest, OutputConstraintSpec

REQUEST = GenerateRequest("a", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4))


def test_the_same_request_under_another_id_is_a_suspect_already():
    suspects = CrashSuspects()

    assert suspects.record(REQUEST) is False
    assert suspects.record(msgspec.structs.replace(REQUEST, request_id="b")) is True


def test_other_work_is_not_a_suspect():
    suspects = CrashSuspects()
    suspects.record(REQUEST)

    others = [
        msgspec.structs.replace(REQUEST, prompt_token_ids=[1, 2, 4]),
        msgspec.structs.replace(REQUEST, params=SamplingParams(temperature=0.0, max_tokens=5)),
        msgspec.structs.replace(REQUEST, constraint=OutputConstraintSpec("regex", "a+")),
    ]

    assert [suspects.record(other) for other in others] == [False, False, False]


def test_the_oldest_suspects_are_forgotten_first():
    suspects = CrashSuspects(max_suspects=2)
    first, second, third = (msgspec.structs.replace(REQUEST, prompt_token_ids=[n]) for n in (1, 2, 3))
    for request in (first, second, third):
        suspects.record(request)

    assert suspects.record(third) is True
    assert suspects.record(first) is False
