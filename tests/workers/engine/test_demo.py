import subprocess
import sys

import pytest


@pytest.mark.slow
def test_make_run_demo_answers_and_reuses_the_prefix():
    completed = subprocess.run(
        [sys.executable, "-m", "workers.engine.demo", "--max-tokens", "12"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert "Paris" in completed.stdout
    assert "served from the prefix cache" in completed.stdout
    assert "tokens/s" in completed.stdout
