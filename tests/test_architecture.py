"""The project's layering holds: the import-linter contracts in pyproject.toml (layers from the control
plane down to workers.protocol, no cycles between sibling modules or packages, no Django below the
control plane) pass on the code as it is. Run in a fresh interpreter, as `lint-imports` would."""

import subprocess
import sys
import textwrap
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

LINT = (
    "import sys\n"
    "from importlinter.cli import lint_imports\n"
    "sys.exit(lint_imports(config_filename=sys.argv[1], no_cache=True, no_logo=True))"
)


def lint_imports(root: Path, config: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", LINT, str(config)], cwd=root, capture_output=True, text=True, timeout=300
    )


def test_the_import_contracts_hold():
    linted = lint_imports(REPO_ROOT, REPO_ROOT / "pyproject.toml")

    assert linted.returncode == 0, linted.stdout + linted.stderr


def test_the_contracts_catch_an_import_that_runs_upward(tmp_path):
    """The same kinds of contract, on a copy of the layering in miniature: an engine module that
    imports the recipe, and two sibling modules that import each other, each break one."""
    for name, body in {
        "recipe/__init__.py": "",
        "recipe/api.py": "import workers.engine.core\n",
        "workers/__init__.py": "",
        "workers/engine/__init__.py": "",
        "workers/engine/core.py": "import workers.engine.request\n",
        "workers/engine/request.py": "import workers.engine.core\nimport recipe.api\n",
    }.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body)
    config = tmp_path / "contracts.toml"
    config.write_text(
        textwrap.dedent(
            """
            [tool.importlinter]
            root_packages = ["recipe", "workers"]

            [[tool.importlinter.contracts]]
            name = "layers"
            type = "layers"
            layers = ["recipe", "workers"]

            [[tool.importlinter.contracts]]
            name = "acyclic"
            type = "acyclic_siblings"
            ancestors = ["recipe", "workers"]
            """
        )
    )

    linted = lint_imports(tmp_path, config)

    assert linted.returncode == 1
    assert "layers BROKEN" in linted.stdout
    assert "acyclic BROKEN" in linted.stdout
