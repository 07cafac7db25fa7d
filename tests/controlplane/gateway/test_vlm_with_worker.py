"""The tiny VLM (tests.vlm_model) served end to end: a real worker process loads it, the live gateway
serves it, and a text request's greedy answer is the offline engine's for the same prompt. (Its
images need the encode pool, which tests elsewhere add.)"""

import httpx
import pytest

from recipe.api import ServedModel, prepare_request
from tests.controlplane.gateway.helpers import key_headers
from tests.controlplane.gateway.live import live_gateway, served_models, worker_process
from tests.vlm_model import build_tiny_vlm
from workers.engine import LLM, SamplingParams
from workers.engine.weights import resolve_model

# The server's threads only see committed rows.
pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return build_tiny_vlm(tmp_path_factory.mktemp("models") / "tiny-vlm")


@pytest.fixture(scope="module")
def gateway_url(vlm_dir, tmp_path_factory, django_db_setup, django_db_blocker) -> str:
    with worker_process(tmp_path_factory.mktemp("worker"), vlm_dir) as worker, served_models(vlm_dir):
        with live_gateway(worker, django_db_blocker) as url:
            yield url


def test_a_text_answer_of_the_served_tiny_vlm_is_the_offline_engines(gateway_url, vlm_dir, make_api_key):
    # given
    body = {
        "model": vlm_dir.name,
        "messages": [{"role": "user", "content": "Describe a cat."}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }

    # when
    with httpx.Client(base_url=gateway_url, timeout=60) as client:
        answer = client.post("/v1/chat/completions", json=body, headers=key_headers(make_api_key()))

    # then
    assert answer.status_code == 200, answer.text
    model = ServedModel.from_model_files(resolve_model(vlm_dir), 2048)
    prompt = prepare_request("chat.completions", body, {model.name: model}).prompt_token_ids
    (offline,) = LLM(vlm_dir, kv_cache_bytes=1 << 24).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    )
    usage = answer.json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(prompt), MAX_TOKENS)
    assert answer.json()["choices"][0]["message"]["content"] == offline.outputs[0].text != ""
