from tests.workers.test_imports import loaded_after_import


def test_the_benchmark_imports_without_torch_or_django():
    # Only resolving a packaged model name for its tokenizer loads torch, and only when run.
    assert loaded_after_import(["bench.serve.cli"], ["torch", "django"]) == []
