import logging

from controlplane.supervisor import Supervisor, Timer


def test_a_timer_runs_once_per_interval_and_survives_its_failures(caplog):
    runs = []

    def run():
        runs.append(len(runs))
        if len(runs) == 2:
            raise RuntimeError("broker down")

    timer = Timer("eplb", 30.0, run, due_at=100.0)
    supervisor = Supervisor([], [timer])

    with caplog.at_level(logging.ERROR, logger="controlplane.supervisor"):
        for now in (99.0, 100.0, 110.0, 129.9, 130.0, 159.0, 160.0):
            supervisor._run_timers(now)

    assert runs == [0, 1, 2]  # at 100, 130 (failed, logged) and 160
    assert "eplb failed" in caplog.text
