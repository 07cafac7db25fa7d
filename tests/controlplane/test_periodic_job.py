import logging

from controlplane.supervisor import PeriodicJob


def test_a_periodic_job_runs_once_per_interval_and_survives_its_failures(caplog):
    runs = []

    def run():
        runs.append(len(runs))
        if len(runs) == 2:
            raise RuntimeError("broker down")

    job = PeriodicJob("eplb", 30.0, run)

    with caplog.at_level(logging.ERROR, logger="controlplane.supervisor"):
        for now in (100.0, 110.0, 129.9, 130.0, 159.0, 160.0):
            job.run_if_due(now)

    assert runs == [0, 1, 2]  # at 100, 130 (failed, logged) and 160
    assert "periodic job eplb failed" in caplog.text
