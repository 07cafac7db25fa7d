"""Images through the live stack (`serve --encode 2 --model <tiny VLM>`: two encode workers, a prefill
and a decode worker, the store on) with the official SDKs: every API's image forms give the offline
engine's greedy tokens; the same image twice hits the encoders' embedding cache and the KV store,
another image does not share its KV; bad images are the protocol's 400 and nothing exits; an encoder
stopped mid-request has its requests retried on the other."""

import base64
import http.server
import io
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import numpy as np
import openai
import pytest
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from recipe.api import RequestLimits, ServedModel, prepare_request
from tests.controlplane.gateway.images import bomb_png, truncated_png
from tests.e2e.conftest import start_stack, stop_stack
from tests.e2e.test_failover import worker_pid
from tests.vlm_model import build_tiny_vlm
from workers.engine import LLM, SamplingParams
from workers.engine.weights import resolve_model

pytestmark = pytest.mark.slow

MAX_TOKENS = 6
MAX_MODEL_LEN = 2048
SYSTEM = "You look at pictures and describe them in a few words, plainly and without guessing."
TIMEOUT_S = 120.0
# The test's image server is on loopback: the stack and the offline reference may fetch from it.
ALLOWED_NETWORK = "127.0.0.0/8"
LIMITS = RequestLimits(image_fetch_allowed_networks=(ALLOWED_NETWORK,))


def picture(seed: int, width: int = 60, height: int = 40) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def png_bytes(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def data_url(image: Image.Image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


class ImageServer:
    """A local HTTP server of PNGs (an operator's image service: SLUICE_IMAGE_FETCH_ALLOWED_NETWORKS)."""

    def __init__(self, images: dict[str, bytes]) -> None:
        self.hits: list[str] = []
        served = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (the stdlib's name)
                served.hits.append(self.path)
                body = images.get(self.path)
                self.send_response(200 if body else 404)
                self.send_header("content-type", "image/png")
                self.send_header("content-length", str(len(body or b"")))
                self.end_headers()
                self.wfile.write(body or b"")

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}{path}"

    def close(self) -> None:
        self.server.shutdown()


CAT, DOG, BIRD = picture(1), picture(2, 40, 70), picture(3)


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return build_tiny_vlm(tmp_path_factory.mktemp("models") / "tiny-vlm")


@pytest.fixture(scope="module")
def image_server():
    server = ImageServer({"/cat.png": png_bytes(CAT), "/dog.png": png_bytes(DOG)})
    yield server
    server.close()


@pytest.fixture(scope="module")
def vlm_stack(tmp_path_factory, vlm_dir):
    # A database of its own, as the other modules' stacks have: the session's stack registers workers of
    # the same names (prefill-0, decode-0) serving a text-only model, which this gateway must not see.
    tmp = tmp_path_factory.mktemp("vlm-stack")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SLUICE_IMAGE_FETCH_ALLOWED_NETWORKS", ALLOWED_NETWORK)
        process, stack = start_stack(tmp, f"sqlite:///{tmp / 'vlm.sqlite3'}", "vlm", f"--model={vlm_dir}", "--encode=2")
    try:
        wait_for_encoders(stack, 2)
        yield stack, process
    finally:
        stop_stack(process)


@pytest.fixture(scope="module")
def offline(vlm_dir):
    model = ServedModel.from_model_files(resolve_model(vlm_dir), MAX_MODEL_LEN)
    llm = LLM(vlm_dir, kv_cache_bytes=1 << 24)

    def answer(protocol: str, body: dict, images: list[Image.Image]) -> str:
        prompt = prepare_request(protocol, body, {model.name: model}, LIMITS).prompt_token_ids
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        (output,) = llm.generate([prompt], params, images=[images])
        return output.outputs[0].text

    return answer


def metrics(stack) -> dict[tuple[str, str], float]:
    text = httpx.get(f"{stack.base_url}/metrics", timeout=30).text
    return {
        (sample.name, sample.labels.get("worker", "")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def encoder_total(stack, name: str) -> float:
    return sum(value for (metric, worker), value in metrics(stack).items() if metric == name and worker)


def wait_for_encoders(stack, count: int) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while sum(1 for metric, _ in metrics(stack) if metric == "sluice:encoder_patches_in_flight") < count:
        assert time.monotonic() < deadline, "the encoders did not report"
        time.sleep(0.5)


def wait_until_idle(stack) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while encoder_total(stack, "sluice:encoder_patches_in_flight") > 0:
        assert time.monotonic() < deadline, "the encoders never emptied"
        time.sleep(0.1)


def chat_body(model: str, *urls: str, text: str = "What is in the picture?") -> dict:
    parts = [{"type": "text", "text": text}, *({"type": "image_url", "image_url": {"url": url}} for url in urls)]
    return {
        "model": model,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": parts}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }


def chat(stack, body: dict):
    extra = {"ignore_eos": True}
    return stack.openai(timeout=TIMEOUT_S).chat.completions.create(**body, extra_body=extra)


def test_chat_images_by_data_url_and_by_url_answer_as_the_offline_engine(vlm_stack, vlm_dir, offline, image_server):
    stack, _ = vlm_stack
    for body, images in (
        (chat_body(vlm_dir.name, data_url(CAT)), [CAT]),
        (chat_body(vlm_dir.name, image_server.url("/dog.png"), data_url(CAT)), [DOG, CAT]),
    ):
        answer = chat(stack, body)
        assert answer.choices[0].message.content == offline("chat.completions", body, images) != ""
    assert "/dog.png" in image_server.hits


def test_responses_input_image_answers_as_the_offline_engine(vlm_stack, vlm_dir, offline, image_server):
    stack, _ = vlm_stack
    body = {
        "model": vlm_dir.name,
        "instructions": SYSTEM,
        "input": [
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "What is in the picture?"},
                    {"type": "input_image", "image_url": image_server.url("/cat.png")},
                ],
            }
        ],
        "max_output_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    answer = stack.openai(timeout=TIMEOUT_S).responses.create(**body, extra_body={"ignore_eos": True})
    assert answer.output_text == offline("responses", body, [CAT]) != ""


def test_messages_images_by_base64_and_by_url_answer_as_the_offline_engine(vlm_stack, vlm_dir, offline, image_server):
    stack, _ = vlm_stack
    base64_block = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(png_bytes(DOG)).decode()},
    }
    url_block = {"type": "image", "source": {"type": "url", "url": image_server.url("/cat.png")}}
    body = {
        "model": vlm_dir.name,
        "system": SYSTEM,
        "messages": [{"role": "user", "content": [base64_block, {"type": "text", "text": "And this?"}, url_block]}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    client = stack.anthropic(timeout=TIMEOUT_S)
    # This SDK's signature lacks `temperature`: it goes in the body as the others' extras do.
    fields = {name: value for name, value in body.items() if name != "temperature"}
    answer = client.messages.create(**fields, extra_body={"ignore_eos": True, "temperature": 0})
    assert answer.content[0].text == offline("messages", body, [DOG, CAT]) != ""
    counted = client.messages.count_tokens(model=body["model"], system=SYSTEM, messages=body["messages"])
    assert counted.input_tokens == answer.usage.input_tokens + answer.usage.cache_read_input_tokens


def test_the_same_image_twice_hits_the_embedding_cache_and_the_store_and_another_image_shares_no_kv(vlm_stack, vlm_dir):
    stack, _ = vlm_stack
    hits_before = encoder_total(stack, "sluice:embedding_cache_hits_total")
    body = chat_body(vlm_dir.name, data_url(BIRD), text="Describe this bird.")
    model = ServedModel.from_model_files(resolve_model(vlm_dir), MAX_MODEL_LEN)
    prompt = prepare_request("chat.completions", body, {model.name: model}).prompt_token_ids
    first_placeholder = prompt.index(model.vision.image_token_id)

    first = chat(stack, body)
    # Once the encoders report nothing in flight, the same image goes to the encoder that encoded it.
    wait_until_idle(stack)
    second = chat(stack, body)
    other = chat(stack, chat_body(vlm_dir.name, data_url(picture(4)), text="Describe this bird."))

    assert second.choices[0].message.content == first.choices[0].message.content
    assert second.usage.prompt_tokens_details.cached_tokens > first_placeholder
    # Another image shares the text before it, and no block from its first placeholder on.
    assert other.usage.prompt_tokens_details.cached_tokens <= first_placeholder
    deadline = time.monotonic() + 10
    while encoder_total(stack, "sluice:embedding_cache_hits_total") <= hits_before:
        assert time.monotonic() < deadline, "no embedding-cache hit reported"
        time.sleep(0.2)


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("data:image/png;base64," + base64.b64encode(bomb_png()).decode(), "pixels"),
        ("data:image/png;base64," + base64.b64encode(truncated_png()).decode(), "truncated"),
        ("data:text/plain;base64," + base64.b64encode(b"not an image").decode(), "image type"),
        ("http://169.254.169.254/latest/meta-data/cat.png", "not public"),
    ],
    ids=["bomb", "truncated", "not-an-image", "metadata-address"],
)
def test_bad_images_are_the_protocols_400_naming_the_field_and_the_stack_serves_on(vlm_stack, vlm_dir, url, says):
    stack, _ = vlm_stack
    with pytest.raises(openai.BadRequestError) as refused:
        chat(stack, chat_body(vlm_dir.name, url))
    assert refused.value.body["param"] == "messages[1].content[1].image_url.url", refused.value.body
    assert says in refused.value.body["message"]
    assert chat(stack, chat_body(vlm_dir.name, data_url(CAT))).choices[0].message.content


def test_too_many_images_are_refused_by_anthropic_shape(vlm_stack, vlm_dir):
    stack, _ = vlm_stack
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    block["source"]["data"] = base64.b64encode(png_bytes(CAT)).decode()
    with pytest.raises(anthropic.BadRequestError) as refused:
        stack.anthropic().messages.create(
            model=vlm_dir.name, max_tokens=4, messages=[{"role": "user", "content": [block] * 17}]
        )
    assert "at most 16" in refused.value.body["error"]["message"]


def test_an_encoder_stopped_mid_request_has_its_requests_retried_on_the_other(vlm_stack, vlm_dir, offline):
    stack, process = vlm_stack
    stopped = worker_pid(os.getsid(process.pid), "encode-0")
    bodies = [chat_body(vlm_dir.name, data_url(picture(10 + index))) for index in range(6)]
    os.kill(stopped, signal.SIGSTOP)  # its heartbeats stop, and requests sent to it get no answer
    try:
        with ThreadPoolExecutor(len(bodies)) as pool:
            answers = list(pool.map(lambda body: chat(stack, body), bodies))
    finally:
        os.kill(stopped, signal.SIGKILL)
        os.kill(stopped, signal.SIGCONT)
    for body, answer, index in zip(bodies, answers, range(6), strict=True):
        assert answer.choices[0].message.content == offline("chat.completions", body, [picture(10 + index)])
