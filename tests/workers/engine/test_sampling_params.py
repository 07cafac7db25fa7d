import math

import msgspec
import pytest

from workers.protocol.errors import InvalidRequestError
from workers.protocol.sampling_params import SamplingParams, decode_sampling_params, invalid_request_from

# (field, rejected value, message it must produce); each boundary from both sides together with ACCEPTED.
REJECTED = [
    ("n", 0, "n must be >= 1, got 0"),
    ("temperature", -0.5, "temperature must be >= 0, got -0.5"),
    ("top_p", 0.0, "top_p must be in (0, 1], got 0.0"),
    ("top_p", 1.5, "top_p must be in (0, 1], got 1.5"),
    ("top_k", -2, "top_k must be -1, 0 (disabled) or >= 1, got -2"),
    ("min_p", -0.01, "min_p must be in [0, 1], got -0.01"),
    ("min_p", 1.01, "min_p must be in [0, 1], got 1.01"),
    ("repetition_penalty", 0.0, "repetition_penalty must be > 0, got 0.0"),
    ("frequency_penalty", -2.01, "frequency_penalty must be in [-2, 2], got -2.01"),
    ("frequency_penalty", 2.01, "frequency_penalty must be in [-2, 2], got 2.01"),
    ("presence_penalty", -2.01, "presence_penalty must be in [-2, 2], got -2.01"),
    ("presence_penalty", 2.01, "presence_penalty must be in [-2, 2], got 2.01"),
    ("max_tokens", 0, "max_tokens must be >= 1, got 0"),
    ("stop", ("end", ""), "stop must not contain empty strings, got ('end', '')"),
    ("stop_token_ids", (2, -1), "stop_token_ids must be >= 0, got -1"),
    ("logprobs", -1, "logprobs must be in [0, 20], got -1"),
    ("logprobs", 21, "logprobs must be in [0, 20], got 21"),
    ("logit_bias", {-1: 1.0}, "logit_bias token ids must be >= 0, got -1"),
    ("logit_bias", {5: 100.5}, "logit_bias values must be in [-100, 100], got 100.5 for token 5"),
    ("logit_bias", {5: -100.5}, "logit_bias values must be in [-100, 100], got -100.5 for token 5"),
]

ACCEPTED = [
    ("n", 1),
    ("temperature", 0.0),
    ("temperature", 1e-30),
    ("top_p", 1e-6),
    ("top_p", 1.0),
    ("top_k", -1),
    ("top_k", 0),
    ("top_k", 1),
    ("min_p", 0.0),
    ("min_p", 1.0),
    ("repetition_penalty", 1e-6),
    ("frequency_penalty", -2.0),
    ("frequency_penalty", 2.0),
    ("presence_penalty", -2.0),
    ("presence_penalty", 2.0),
    ("max_tokens", 1),
    ("max_tokens", None),
    ("stop", ("end",)),
    ("stop_token_ids", (0,)),
    ("logprobs", 0),
    ("logprobs", 20),
    ("logprobs", None),
    ("logit_bias", {0: -100.0, 1: 100.0}),
    ("seed", -(2**63)),
    ("seed", 2**64 - 1),
]

FLOAT_FIELDS = ["temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"]
NON_FINITE = [
    (field, value, f"{field} must be a finite number, got {value}")
    for field in FLOAT_FIELDS
    for value in (math.nan, math.inf, -math.inf)
] + [("logit_bias", {3: math.nan}, "logit_bias values must be in [-100, 100], got nan for token 3")]


def _case_id(case: tuple) -> str:
    return f"{case[0]}={case[1]!r}"


@pytest.mark.parametrize("case", REJECTED + NON_FINITE, ids=_case_id)
def test_constructor_rejects_bad_value_naming_field_and_value(case: tuple) -> None:
    field, value, message = case

    with pytest.raises(InvalidRequestError) as raised:
        SamplingParams(**{field: value})

    assert str(raised.value) == message


@pytest.mark.parametrize("case", ACCEPTED, ids=_case_id)
def test_constructor_accepts_boundary_value(case: tuple) -> None:
    field, value = case

    params = SamplingParams(**{field: value})

    assert getattr(params, field) == value


@pytest.mark.parametrize("case", REJECTED + NON_FINITE, ids=_case_id)
def test_msgpack_decode_raises_validation_error_caused_by_invalid_request(case: tuple) -> None:
    field, value, message = case
    payload = msgspec.msgpack.encode({field: value})

    with pytest.raises(msgspec.ValidationError) as raised:
        msgspec.msgpack.decode(payload, type=SamplingParams)

    assert str(raised.value) == message
    assert isinstance(raised.value.__cause__, InvalidRequestError)
    assert str(raised.value.__cause__) == message


@pytest.mark.parametrize("case", REJECTED, ids=_case_id)
def test_json_decode_raises_validation_error_caused_by_invalid_request(case: tuple) -> None:
    field, value, message = case
    payload = msgspec.json.encode({field: value})

    with pytest.raises(msgspec.ValidationError) as raised:
        msgspec.json.decode(payload, type=SamplingParams)

    assert isinstance(raised.value.__cause__, InvalidRequestError)
    assert str(raised.value.__cause__) == message


@pytest.mark.parametrize("encoding", ["json", "msgpack"])
@pytest.mark.parametrize("case", REJECTED, ids=_case_id)
def test_decode_sampling_params_raises_the_invalid_request_error(case: tuple, encoding: str) -> None:
    field, value, message = case
    encode = msgspec.json.encode if encoding == "json" else msgspec.msgpack.encode

    with pytest.raises(InvalidRequestError) as raised:
        decode_sampling_params(encode({field: value}), encoding=encoding)

    assert str(raised.value) == message


@pytest.mark.parametrize("case", ACCEPTED, ids=_case_id)
def test_msgpack_decode_accepts_boundary_value(case: tuple) -> None:
    field, value = case

    params = decode_sampling_params(msgspec.msgpack.encode({field: value}), encoding="msgpack")

    assert getattr(params, field) == value


def test_json_example_from_the_contract_surfaces_invalid_request() -> None:
    with pytest.raises(msgspec.ValidationError) as raised:
        msgspec.json.decode(b'{"temperature": -1}', type=SamplingParams)

    assert isinstance(raised.value.__cause__, InvalidRequestError)
    assert str(invalid_request_from(raised.value)) == "temperature must be >= 0, got -1.0"


def test_nested_struct_error_keeps_the_cause_and_adds_the_path() -> None:
    class Envelope(msgspec.Struct):
        params: SamplingParams

    with pytest.raises(msgspec.ValidationError) as raised:
        msgspec.json.decode(b'{"params": {"top_p": 2}}', type=Envelope)

    assert str(raised.value) == "top_p must be in (0, 1], got 2.0 - at `$.params`"
    assert str(invalid_request_from(raised.value)) == "top_p must be in (0, 1], got 2.0"


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b'{"top_k": 1.5}', "Expected `int`, got `float` - at `$.top_k`"),
        (b'{"temperature": "hot"}', "Expected `float`, got `str` - at `$.temperature`"),
        (b'{"beam_width": 4}', "Object contains unknown field `beam_width`"),
        (b'{"temperature": ', "Input data was truncated"),
    ],
)
def test_decode_sampling_params_turns_msgspec_own_errors_into_invalid_request(payload: bytes, message: str) -> None:
    with pytest.raises(InvalidRequestError) as raised:
        decode_sampling_params(payload, encoding="json")

    assert str(raised.value) == message


def test_json_round_trip_omits_defaults_and_reads_string_token_ids() -> None:
    params = SamplingParams(temperature=0.7, stop=("\n",), logit_bias={42: -5.0}, seed=7)

    payload = msgspec.json.encode(params)

    assert payload == b'{"temperature":0.7,"seed":7,"stop":["\\n"],"logit_bias":{"42":-5.0}}'
    assert msgspec.json.decode(payload, type=SamplingParams) == params
    assert msgspec.json.encode(SamplingParams()) == b"{}"


def test_is_greedy_only_at_temperature_zero() -> None:
    assert SamplingParams(temperature=0).is_greedy
    assert not SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams().is_greedy
