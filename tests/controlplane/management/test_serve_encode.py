"""`serve --encode N`: N vision encoders of the model the other workers serve, refused at start for a
text-only model (it has no vision tower to run); the node agent starts an encoder with a prefill
worker's endpoints, no transfer endpoint and no KV store."""

import json

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from controlplane.management.commands import serve
from controlplane.management.commands.serve import encode_roles
from workers.engine.weights import ModelFiles
from workers.worker import node_agent
from workers.worker.args import ROLES, WorkerArgs
from workers.worker.node_agent import NodeAgent, WorkerLaunch


def model_files(name: str, architectures: list[str]) -> ModelFiles:
    return ModelFiles(
        name=name,
        directory=None,
        config={"architectures": architectures},
        weight_files=(),
        tokenizer_file=None,
        tokenizer_config={},
        generation_config={},
    )


def test_encoders_of_a_text_only_model_are_refused_naming_the_option_and_the_model():
    text_only = model_files("smollm2-135m-instruct", ["LlamaForCausalLM"])

    with pytest.raises(CommandError) as refused:
        encode_roles(1, text_only)

    message = str(refused.value)
    assert message.startswith("--encode 1: model 'smollm2-135m-instruct' is text-only (architecture: LlamaForCausalLM)")
    assert "leave out --encode" in message
    # without encoders a text-only model is served as before
    assert encode_roles(0, text_only) == []


def test_a_vision_language_model_gets_its_encoders():
    for architecture in ("SmolVLMForConditionalGeneration", "Idefics3ForConditionalGeneration"):
        assert encode_roles(2, model_files("smolvlm", [architecture])) == ["encode", "encode"]


@pytest.mark.django_db
def test_serve_refuses_encoders_of_a_text_only_model_before_it_starts_anything(tmp_path, monkeypatch):
    # given a text-only model directory, and serve's start of its children caught should it get there
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    started = []
    monkeypatch.setattr(serve.Command, "_serve", lambda self, *args, **kwargs: started.append(kwargs))

    # when serve is asked for an encoder of it
    with pytest.raises(CommandError, match=r"^--encode 1: model '.*' is text-only"):
        call_command("serve", "--encode=1", f"--model={tmp_path}", "--no-kv-store")

    # then it stopped at the option, and a negative count is refused too
    assert started == []
    with pytest.raises(CommandError, match="--encode must be at least 0, got -1"):
        call_command("serve", "--encode=-1", f"--model={tmp_path}", "--no-kv-store")


@pytest.mark.skipif("encode" not in ROLES, reason="the encode worker role (workers.worker.args.ROLES) is not in yet")
def test_the_node_agent_starts_an_encoder_with_a_prefill_worker_s_endpoints_and_no_kv_store(tmp_path, monkeypatch):
    # given a host whose worker options name a KV store (its prefill and decode workers use it)
    started = []
    monkeypatch.setattr(node_agent.subprocess, "Popen", lambda argv, **_: started.append(argv) or FakeProcess())
    agent = NodeAgent(
        runtime_dir=tmp_path,
        registry_endpoint="ipc:///registry",
        worker_options=lambda role: ["--kv-store=/kv", "--kv-gc-interval=0"],
        on_exit=lambda *exit: None,
    )

    # when it starts an encoder of the pool's model
    launched = agent.start(WorkerLaunch(1, "encode-1", "encode", "encode", "smolvlm"))

    # then the encoder has request and heartbeat endpoints, no transfer endpoint, and no KV store
    args = WorkerArgs.from_argv(started[0][3:])
    assert (args.role, args.pool, args.engine.model, args.engine.kv_store) == ("encode", "encode", "smolvlm", None)
    assert args.transfer_endpoint is None
    assert (launched.request_endpoint, launched.heartbeat_endpoint) == (
        f"ipc://{tmp_path}/encode-1.req",
        f"ipc://{tmp_path}/encode-1.hb",
    )


class FakeProcess:
    pid = 4242
