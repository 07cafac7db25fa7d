"""sluice installed the way a user installs it (`pip install .`, not editable) into a fresh virtualenv,
run with a fresh HOME from an empty directory: nothing may come from the checkout."""

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.cli.running import user_env
from tests.e2e.conftest import MODEL, ROOT, Stack, free_port, stop_stack, wait_until_ready
from workers.engine.weights import default_cache_dir


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The virtualenv's bin directory. The virtualenv finds the dependencies in this interpreter's
    site-packages (a .pth file), so nothing is downloaded; sluice itself is built from a copy of the
    checkout's files, so the build leaves nothing in the checkout."""
    tmp = tmp_path_factory.mktemp("installed")
    source = tmp / "source"
    tracked = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, tracked.split("\0")):
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(purelib) / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", python, "install", "--quiet", "--no-deps", "--no-build-isolation"]
        + ["--no-index", str(source)],
        check=True,
        timeout=300,
    )
    return venv / "bin"


def test_the_installed_package_holds_every_file_beside_the_code_it_reads(installed, user):
    # The templates Django finds in the installed dashboard app (the rest it reads is Python).
    home, cwd = user
    found = subprocess.run(
        [installed / "python", "-c", "import dashboard, pathlib; print(pathlib.Path(dashboard.__file__).parent)"],
        env=user_env(home),
        cwd=cwd,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert Path(found).is_relative_to(installed.parent)
    for template in ("templates/dashboard/index.html", "templates/registration/login.html"):
        assert (Path(found) / template).is_file()


@pytest.mark.slow
def test_the_installed_sluice_migrates_serves_and_stops(installed, user, smollm2_files):
    # given a user with a fresh HOME in an empty directory, the model already converted into the
    # real cache (the test's HOME has none)
    home, cwd = user
    env = user_env(home, SLUICE_CACHE_DIR=str(default_cache_dir()))

    def sluice(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [installed / "sluice", *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=120
        )

    # when they ask for help and migrate
    helped, migrated = sluice("--help"), sluice("migrate")

    # then both work, the database in the default data directory
    assert helped.returncode == 0 and "serve" in helped.stdout, helped.stderr
    assert migrated.returncode == 0, migrated.stderr
    data = home / ".local" / "share" / "sluice"
    assert (data / "sluice.sqlite3").is_file()

    # when they serve the packaged model
    port = free_port()
    log = cwd.parent / "serve.log"
    with open(log, "w") as output:
        process = subprocess.Popen(
            [installed / "sluice", "serve", MODEL, f"--port={port}", "--workers=1"],
            env=env,
            cwd=cwd,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(base_url, process)

        # then the banner's dev key gets a chat completion
        banner = [line.split()[-1] for line in log.read_text().splitlines() if line.lstrip().startswith("dev key")]
        client = Stack(base_url=base_url, api_key=banner[0], env=env).openai(timeout=60)
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=8
        )
        assert reply.choices[0].message.content
    finally:
        # and Ctrl-C stops everything
        stop_stack(process)
    assert process.returncode == 0, log.read_text()
    assert list(cwd.iterdir()) == []
    assert (data / "kvstore").is_dir()
