"""The docs name files that exist: every repository path in backticks in the README, docker/README.md
and docs/ is a file or folder of the tree (a move that forgets a doc fails here)."""

import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
DOCS = [REPO_ROOT / "README.md", REPO_ROOT / "docker" / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
TOP_FOLDERS = ("workers", "controlplane", "recipe", "kernels", "dashboard", "bench", "tests", "docker", "migrations")
PATH = re.compile(r"`((?:" + "|".join(TOP_FOLDERS) + r")/[\w./-]*)`")


def named_paths(text: str) -> list[str]:
    return [match.group(1).rstrip("/") for match in PATH.finditer(text)]


def exists(path: str) -> bool:
    # A file the user makes from an example (docker/.env from docker/.env.example) counts as named.
    return any((REPO_ROOT / candidate).exists() for candidate in (path, f"{path}.example"))


def test_named_paths_are_found_in_backticks():
    assert named_paths("see `workers/engine/kv/` and `bench/gpu.sh`, not workers/x.py") == [
        "workers/engine/kv",
        "bench/gpu.sh",
    ]


@pytest.mark.parametrize("doc", DOCS, ids=lambda doc: str(doc.relative_to(REPO_ROOT)))
def test_every_path_a_doc_names_exists(doc):
    missing = sorted({path for path in named_paths(doc.read_text()) if not exists(path)})

    assert missing == []
