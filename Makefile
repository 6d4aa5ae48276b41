# Two commands do all the set-up: `make run` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed

.PHONY: run test test-docker lint bench bench-load clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --config-settings editable_mode=compat -e '.[test,spark]'
	touch $(STAMP)

run: $(STAMP)
	mkdir -p data
	$(VENV)/bin/queued serve --data-dir ./data --host 127.0.0.1

test: $(STAMP)
	$(PY) -m pytest -q
	$(PY) -m ruff check queued tests bench deploy/spark pyspark_queued.py
	$(PY) -m mypy

# The Docker image end to end (tests/docker): setup.sh makes sure a dockerd runs (installs
# docker.io and starts dockerd in the background if none answers; it is left running) and
# builds the local base image queued-base:bookworm (debootstrap) if missing; the test then
# builds the image, runs it, puts/gets, scrapes /metrics, stops it and restarts it on the
# same volume. Exit status 77 of setup.sh: this machine cannot run dockerd; the test skips.
test-docker: $(STAMP)
	tests/docker/setup.sh || [ $$? -eq 77 ]
	timeout -s INT -k 60 1800 $(PY) -m pytest -m docker -s -v tests/docker

lint: $(STAMP)
	$(PY) -m ruff check queued tests bench deploy/spark pyspark_queued.py
	$(PY) -m mypy

bench: $(STAMP)
	$(PY) bench/journal_bench.py

bench-load: $(STAMP)
	$(PY) bench/load.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
