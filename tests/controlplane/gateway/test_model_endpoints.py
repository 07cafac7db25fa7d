"""The endpoints that need no worker: /v1/models and /v1/messages/count_tokens."""

import pytest

pytest.importorskip("recipe.api")  # skipped, with the import error, until it exists

from tests.controlplane.gateway.helpers import SMOLLM2, key_headers, valid_body  # noqa: E402


def test_models_lists_the_served_models(api, make_api_key):
    response = api.request("GET", "/v1/models", headers=key_headers(make_api_key()))

    assert response.status_code == 200
    assert [model["id"] for model in response.json()["data"]] == [SMOLLM2]


def test_count_tokens_counts_the_prompt(api, make_api_key, no_workers):
    headers = key_headers(make_api_key(), "x-api-key")
    short = valid_body("messages.count_tokens")
    longer = valid_body("messages.count_tokens", messages=[{"role": "user", "content": "Say hello. " * 20}])

    counts = [
        api.post("messages.count_tokens", body, headers=headers).json()["input_tokens"] for body in (short, longer)
    ]

    assert 0 < counts[0] < counts[1]
