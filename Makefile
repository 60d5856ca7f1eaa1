# One entry point: every target builds .venv from nothing when it is missing.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: train test bench clean

$(STAMP): requirements.lock requirements-test.lock pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --no-deps -r requirements.lock -r requirements-test.lock
	$(PY) -m pip install --no-deps -e .
	touch $(STAMP)

train: $(STAMP)
	$(PY) examples/quickstart.py

test: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV)
