# The README's two quick-start commands: `make demo` and `make test`.
# Both create the virtual environment when missing and install everything from the pinned files.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo lint test test-slow bench clean

$(STAMP): requirements.txt requirements-nodeps.txt pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -r requirements-nodeps.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(VENV)/bin/plait train

# ruff (pyflakes, pycodestyle, isort, bugbear, pyupgrade) and mypy on src/; CI runs it before the tests.
lint: setup
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/mypy

test: setup
	$(PY) -m pytest -q

test-slow: setup
	$(PY) -m pytest -q -m slow

bench: setup
	$(PY) bench/bench_single.py
	$(PY) bench/bench_tp.py
	$(PY) bench/bench_dp.py

clean:
	rm -rf $(VENV) .pytest_cache
