"""What importing a module pulls in: the gateway side never loads torch, and the engine loads neither
Redis nor Django (a GPU machine may have neither). Each check runs in a fresh interpreter, since
this one has imported everything already."""

import subprocess
import sys

import pytest

from tests.workers.worker_process import REPO_ROOT

# The protocol, the text layer and the gateway-side modules that speak them.
GATEWAY_MODULES = [
    "workers.protocol.messages",
    "workers.protocol.sampling_params",
    "workers.protocol.errors",
    "workers.text.tokenizer",
    "workers.text.detokenizer",
    "workers.client.engine_client",
    "workers.client.split_stream",
    "workers.client.control_client",
    "workers.curve",
    "workers.worker.registry",
    "workers.engine.weights",  # the gateway finds its models' tokenizers there
    "recipe.codec_stream",
    "recipe.codec_response",
    "recipe.completions_response",
    "recipe.conversation_requests",
    "recipe.prepared_request",
]
ENGINE_MODULES = ["workers.engine.llm", "workers.engine.engine", "workers.engine.builder", "workers.engine.factory"]


def loaded_after_import(modules: list[str], watched: list[str]) -> list[str]:
    """Which of the `watched` top-level packages a fresh interpreter has loaded after importing `modules`."""
    script = (
        f"import sys, importlib\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        f"print(' '.join(p for p in {watched!r} if p in sys.modules))"
    )
    completed = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert completed.returncode == 0, completed.stderr
    return completed.stdout.split()


def test_the_protocol_and_the_gateway_side_do_not_import_torch():
    assert loaded_after_import(GATEWAY_MODULES, ["torch"]) == []


@pytest.mark.parametrize("module", ENGINE_MODULES)
def test_the_engine_imports_neither_redis_nor_django(module):
    assert loaded_after_import([module], ["redis", "django"]) == []
