# One entry point: every target builds .venv from nothing when it is missing.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: train quickstart test clean

$(STAMP): requirements.lock requirements-test.lock pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --no-deps -r requirements.lock -r requirements-test.lock
	$(PY) -m pip install --no-deps -e .
	touch $(STAMP)

# The main job: TorchRec's DLRM on synthetic click data, on the tpu device.
train: $(STAMP)
	$(PY) examples/dlrm/train.py

quickstart: $(STAMP)
	$(PY) examples/quickstart.py

# The whole suite, then the device tests again with fused mode as the default.
test: $(STAMP)
	$(PY) -m pytest -q
	TPUREC_MODE=fused $(PY) -m pytest -q tests/core tests/sparse/test_tpu_device.py tests/sparse/test_dlrm.py tests/dense/test_programs.py

clean:
	rm -rf $(VENV)
