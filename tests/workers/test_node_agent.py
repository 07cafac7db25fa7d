"""The node agent's process work on its own (no Django): a worker it started that crashes is reported
as an unexpected exit with its code, and a second start of the same instance is refused."""

import pytest

from tests.waiting import wait_until
from tests.workers.worker_process import REPO_ROOT
from workers.node_agent import NodeAgent, WorkerLaunch


def test_a_crashed_worker_is_reported_with_its_exit_code(tmp_path):
    exits = []
    agent = NodeAgent(
        runtime_dir=tmp_path / "run",
        registry_endpoint=f"ipc://{tmp_path}/registry",
        worker_options=lambda role: [],
        on_exit=lambda *exit: exits.append(exit),
        cwd=REPO_ROOT,
    )
    # a worker whose model is nowhere: it starts, fails to build its engine and exits 1 (a crash)
    launch = WorkerLaunch(instance_id=7, worker_id="crashy", pool="mixed", role="mixed", model=str(tmp_path / "none"))
    agent.start(launch)
    try:
        assert agent.held_instances() == [7]
        with pytest.raises(ValueError, match="instance 7 already has a process here"):
            agent.start(launch)

        # when the agent reaps its children
        wait_until(lambda: agent.reap() or exits, 120)
    finally:
        agent.stop_all(grace_s=5)

    # then the exit is reported once, unasked for, with the worker's exit code
    assert exits == [(7, 1, False)]
    assert agent.held_instances() == []
