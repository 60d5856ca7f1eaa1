# One entry point: every target builds .venv from nothing when it is missing.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: train quickstart lint test zoo coverage clean

$(STAMP): requirements.lock requirements-test.lock pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --no-deps -r requirements.lock -r requirements-test.lock
	$(PY) -m pip install --no-deps -e .
	touch $(STAMP)

# The main job: TorchRec's DLRM on synthetic click data, on the tpu device (dlrm_main.py's
# flags; override with `make train TRAIN_FLAGS="--interaction_type dcn ..."`).
TRAIN_FLAGS ?= --batch_size 512 --num_embeddings 10000 --embedding_dim 16 --dense_arch_layer_sizes 64,16 \
	--over_arch_layer_sizes 64,32,1 --adagrad --learning_rate 0.05 --limit_train_batches 300 \
	--limit_val_batches 8 --limit_test_batches 8 --validation_freq_within_epoch 100
train: $(STAMP)
	$(PY) examples/dlrm/train.py $(TRAIN_FLAGS)

quickstart: $(STAMP)
	$(PY) examples/quickstart.py

# Lint (ruff), formatting (ruff format --check) and types (basedpyright, basic mode, against the
# errors recorded in .basedpyright/baseline.json when the check was adopted): settings in
# pyproject.toml, tools pinned in requirements-test.lock.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/basedpyright --pythonpath $(PY)

# Lint, then the whole suite (the device tests in eager and in fused mode) on TEST_WORKERS processes
# (pytest-xdist; tests/conftest.py says how the files are shared out), the slowest tests listed at the end.
TEST_WORKERS ?= 2
test: lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# The model zoo (tests/models): every transformers family x eager/fused/compiled against CPU; `make test`
# runs only its default slice. Results and known failures: docs/zoo.md.
zoo: $(STAMP)
	$(PY) -m pytest -q tests/models -m "zoo or not zoo"

# Every float32 entry of torch's OpInfo database through the tpu device vs CPU (about 25 min on
# 2 cores); fails on a mismatch with tests/dense/opinfo_known_failures.txt, writes docs/ops.md.
coverage: $(STAMP)
	$(PY) tests/dense/opinfo_device.py --doc docs/ops.md

clean:
	rm -rf $(VENV)
