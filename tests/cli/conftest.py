import pytest


@pytest.fixture
def user(tmp_path):
    """A home directory and an empty working directory."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    return home, cwd
