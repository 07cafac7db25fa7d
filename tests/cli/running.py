"""Running `sluice` as a user would: a process with its own HOME, in an empty working directory, with
none of sluice's settings from the test run's environment."""

import os
import subprocess
import sys
from pathlib import Path

from tests.e2e.conftest import ROOT

# Settings a test run may have set that would point sluice at the checkout's or the tests' state.
SETTINGS = ("DATABASE_URL", "SLUICE_VAR_DIR", "SLUICE_DATA_DIR", "XDG_DATA_HOME", "PYTHONPATH")


def user_env(home: Path, **overrides: str) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if name not in SETTINGS}
    return {**env, "HOME": str(home), "PYTHONUNBUFFERED": "1", **overrides}


def sluice_from_checkout(home: Path, cwd: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """`sluice ARGS` from this checkout's code (`python -m controlplane.cli`), not an installed copy."""
    return subprocess.run(
        [sys.executable, "-m", "controlplane.cli", *args],
        env=user_env(home, PYTHONPATH=str(ROOT), **env),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )
