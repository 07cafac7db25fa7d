"""docker/ checked against the code, without a Docker daemon (tests/docker/compose_checks.py)."""

import copy

import pytest

from tests.docker import compose_checks as checks

DOCKER = checks.REPO / "docker"


@pytest.fixture(scope="module")
def env() -> dict[str, str]:
    return checks.read_env_file(DOCKER / ".env.example")


@pytest.fixture(scope="module")
def compose(env) -> dict:
    return checks.load_compose(DOCKER / "compose.yaml", env)


@pytest.fixture(scope="module")
def read() -> set[str]:
    return checks.environment_read_by_code()


def test_every_command_and_flag_is_one_the_code_accepts(compose):
    assert checks.command_problems(compose) == []


def test_every_variable_set_is_read_and_every_required_one_set(compose, read):
    assert checks.environment_problems(compose, read) == []


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.cuda"])
def test_dockerfiles_copy_what_exists_and_set_what_is_read(dockerfile, read):
    assert checks.dockerfile_problems(DOCKER / dockerfile, read) == []


def test_readme_and_env_example_list_every_variable(compose):
    problems = checks.documentation_problems(
        DOCKER / "compose.yaml", DOCKER / ".env.example", DOCKER / "README.md", compose
    )
    assert problems == []


def test_the_scan_finds_settings_read_by_name_and_by_field(read):
    assert {"DATABASE_URL", "SLUICE_CACHE_DIR", "SLUICE_COST_MODEL", "SLUICE_MAX_TOOLS"} <= read
    assert "SLUICE_GRAMMAR_MAX_REGEX_REPEAT" in read or any(name.startswith("SLUICE_GRAMMAR_") for name in read)


def test_a_wrong_worker_flag_is_caught(compose):
    broken = copy.deepcopy(compose)
    broken["services"]["prefill-0"]["command"].append("--kv-stor=/x")
    assert any(p.startswith("prefill-0: manage.py run_worker refuses") for p in checks.command_problems(broken))


def test_an_unknown_management_command_and_uvicorn_option_are_caught(compose):
    broken = copy.deepcopy(compose)
    broken["services"]["registry"]["command"][2] = "run_registri"
    broken["services"]["gateway-1"]["command"].append("--timeout-keepalive=5")
    problems = checks.command_problems(broken)
    assert "registry: manage.py has no command 'run_registri'" in problems
    assert any(p.startswith("gateway-1: uvicorn refuses") for p in problems)


def test_a_node_agent_on_the_wrong_queue_is_caught(compose):
    broken = copy.deepcopy(compose)
    broken["services"]["node-agent-0"]["environment"]["SLUICE_NODE_NAME"] = "agent-9"
    problems = checks.command_problems(broken)
    assert any("node-agent-0: celery worker consumes" in p and "'node.agent-9'" in p for p in problems)


def test_an_unknown_or_missing_variable_is_caught(compose, read):
    broken = copy.deepcopy(compose)
    broken["services"]["gateway-0"]["environment"]["SLUICE_WORKER_ENDPOINT"] = "tcp://x:1|tcp://x:2"
    del broken["services"]["celery-worker"]["environment"]["DATABASE_URL"]
    problems = checks.environment_problems(broken, read)
    assert any(p.startswith("gateway-0: sets SLUICE_WORKER_ENDPOINT,") for p in problems)
    assert "celery-worker: a Django process without ['DATABASE_URL']" in problems


def test_a_copy_of_a_missing_folder_is_caught(tmp_path, read):
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text((DOCKER / "Dockerfile").read_text().replace("COPY recipe recipe", "COPY recipes recipes"))
    assert checks.dockerfile_problems(dockerfile, read) == ["Dockerfile: COPY recipes: no such file in the repository"]


def test_gateways_and_workers_agree_on_endpoints(compose):
    assert checks.endpoint_problems(compose) == []


def test_a_worker_endpoint_no_worker_advertises_is_caught(compose):
    broken = copy.deepcopy(compose)
    command = broken["services"]["decode-0"]["command"]
    command[command.index("--advertise-host=decode-0")] = "--advertise-host=decoder-0"
    problems = checks.endpoint_problems(broken)
    assert any(p.startswith("gateway-0: SLUICE_WORKER_ENDPOINTS names tcp://decode-0:7100|") for p in problems)


def test_every_process_on_the_network_gets_the_cluster_key_from_the_one_shot_export(compose):
    assert checks.curve_key_problems(compose) == []


def test_a_process_without_the_key_or_its_volume_is_caught(compose):
    broken = copy.deepcopy(compose)
    del broken["services"]["decode-0"]["environment"]["SLUICE_CURVE_KEY_FILE"]
    broken["services"]["gateway-1"]["volumes"] = broken["services"]["gateway-1"]["volumes"][:2]
    del broken["services"]["registry"]["depends_on"]["data-plane-key"]
    problems = checks.curve_key_problems(broken)
    assert problems == [
        "registry: may start before data-plane-key wrote /var/lib/sluice/keys/cluster.key",
        "decode-0: speaks ZMQ over the network without SLUICE_CURVE_KEY_FILE",
        "gateway-1: does not mount data-plane-key read-only where /var/lib/sluice/keys/cluster.key is",
    ]
