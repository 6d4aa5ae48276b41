# Two commands do all the set-up: `make run` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed

.PHONY: run test lint bench bench-load clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	mkdir -p data
	$(VENV)/bin/queued serve --data-dir ./data --host 127.0.0.1

test: $(STAMP)
	$(PY) -m pytest -q
	$(PY) -m ruff check queued tests bench
	$(PY) -m mypy

lint: $(STAMP)
	$(PY) -m ruff check queued tests bench
	$(PY) -m mypy

bench: $(STAMP)
	$(PY) bench/journal_bench.py

bench-load: $(STAMP)
	$(PY) bench/load.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
