# Two commands do all the set-up: `make run` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
# Two stamps, one per install: `make run` installs what the server needs (RUN_STAMP);
# `make test` adds the test, Spark and docs extras on top (TEST_STAMP, which needs
# RUN_STAMP). Each is redone only when pyproject.toml is newer, so `make run` after
# `make test` installs nothing and `make test` after `make run` installs only the extras.
# `make docs` needs only the docs extra (DOCS_STAMP), which `make test` installs too.
RUN_STAMP  = $(VENV)/.installed-run
TEST_STAMP = $(VENV)/.installed-test
DOCS_STAMP = $(VENV)/.installed-docs
BROWSER_STAMP = $(VENV)/.installed-browser
# Material for MkDocs prints a notice about MkDocs 2.0 on every build; this turns it off.
MKDOCS = NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs

.PHONY: run test compiled run-compiled test-compiled test-docker test-browser docs lint bench \
	bench-load clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(RUN_STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --config-settings editable_mode=compat -e .
	touch $(RUN_STAMP)

$(TEST_STAMP): $(RUN_STAMP) pyproject.toml
	$(PY) -m pip install --quiet --config-settings editable_mode=compat -e '.[test,spark,docs]'
	touch $(TEST_STAMP) $(DOCS_STAMP)

$(DOCS_STAMP): $(RUN_STAMP) pyproject.toml
	$(PY) -m pip install --quiet --config-settings editable_mode=compat -e '.[docs]'
	touch $(DOCS_STAMP)

run: $(RUN_STAMP)
	mkdir -p data
	$(VENV)/bin/queued serve --data-dir ./data --host 127.0.0.1

# The suite runs in TEST_WORKERS processes (pytest-xdist): much of its time is waiting
# (servers, subprocesses, a JVM), so two workers on two cores take about half the time.
# tests/conftest.py keeps each test file in one worker and the tests of the SparkSession together.
TEST_WORKERS ?= 2
# The whole suite takes 6-7 minutes here. A run that passes SUITE_LIMIT seconds (a worker
# stuck where pytest-timeout's per-test limit cannot reach, such as a crash handler) is
# interrupted, so CI fails with its output well before CI's own limit.
SUITE_LIMIT ?= 1800
PYTEST_SUITE = timeout -s INT -k 60 $(SUITE_LIMIT) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# The docs build is strict and not --quiet (which hides the warnings --strict fails on).
test: $(TEST_STAMP)
	$(MKDOCS) build --strict
	$(PYTEST_SUITE)
	$(PY) -m ruff check queued tests bench tools deploy/spark pyspark_queued.py
	$(PY) -m mypy
	$(PY) -m mypy --strict tools/unasync.py

# The compiled build (docs/development.md "Compiled with mypyc"): tools/build_compiled.py
# copies queued/ into COMPILED_DIR and compiles the hot modules there with mypyc (the
# test extra's), so a .so never sits in the source tree; it rebuilds only when queued/
# changed. `make run-compiled` serves with it first on PYTHONPATH (the start-up log line
# says which build runs); `make test-compiled` runs the whole suite against it, each
# process checking that the compiled modules are the ones imported (tests/compiled_util.py).
COMPILED_DIR ?= build/compiled

compiled: $(TEST_STAMP)
	$(PY) tools/build_compiled.py --out $(COMPILED_DIR)

run-compiled: compiled
	mkdir -p data
	PYTHONPATH=$(abspath $(COMPILED_DIR)) $(VENV)/bin/queued serve --data-dir ./data --host 127.0.0.1

test-compiled: compiled
	COMPILED_BUILD=$(abspath $(COMPILED_DIR)) $(PYTEST_SUITE)

# The Docker image end to end (tests/docker): setup.sh makes sure a dockerd runs (installs
# docker.io and starts dockerd in the background if none answers; it is left running) and
# builds the local base image queued-base:bookworm (debootstrap) if missing; the test then
# builds the image, runs it, puts/gets, scrapes /metrics, stops it and restarts it on the
# same volume. Exit status 77 of setup.sh: this machine cannot run dockerd; the test skips.
test-docker: $(TEST_STAMP)
	tests/docker/setup.sh || [ $$? -eq 77 ]
	timeout -s INT -k 60 1800 $(PY) -m pytest -m docker --timeout 1700 -s -v tests/docker

$(BROWSER_STAMP): $(TEST_STAMP) pyproject.toml
	$(PY) -m pip install --quiet --config-settings editable_mode=compat -e '.[test,browser]'
	touch $(BROWSER_STAMP)

# The web console in a real headless browser (tests/browser): setup.sh installs Debian's
# chromium and chromium-driver if missing (apt-get, needs root); the `browser` extra adds
# Selenium, which drives them (it downloads no browser). Exit status 77 of setup.sh: no
# Chromium and no way to install it; the tests skip. QUEUED_CONSOLE_SCREENSHOT=docs also
# saves the screenshots of the docs (docs/console.png, docs/console-queue.png) there.
test-browser: $(BROWSER_STAMP)
	tests/browser/setup.sh || [ $$? -eq 77 ]
	timeout -s INT -k 60 900 $(PY) -m pytest -m browser --timeout 850 -v tests/browser

lint: $(TEST_STAMP)
	$(PY) -m ruff check queued tests bench tools deploy/spark pyspark_queued.py
	$(PY) -m mypy
	$(PY) -m mypy --strict tools/unasync.py

# The documentation site (mkdocs.yml, docs/, README.md as its front page), served with
# live reload at http://127.0.0.1:8000/ until ^C. `make test` builds it with --strict.
docs: $(DOCS_STAMP)
	$(MKDOCS) serve

bench: $(RUN_STAMP)
	$(PY) bench/journal_bench.py

bench-load: $(RUN_STAMP)
	$(PY) bench/load.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache site
