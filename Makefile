# tf_fusedemb: one-command setup on a fresh machine (see README.md).
# Installs the pinned stack of ../shared/ENVIRONMENT.md into .venv, builds Horovod from
# source with Gloo, builds the custom-op library and installs the package (editable).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.stack-installed
HVD_STAMP := $(VENV)/.horovod-installed
export TF_USE_LEGACY_KERAS := 1
export TF_CPP_MIN_LOG_LEVEL := 2

.PHONY: setup ops test train smoke bench clean
NP ?= 2

setup: netns-tools $(HVD_STAMP) ops

# Emulated hosts (tf_fusedemb.testing.cluster) need iproute2's ip/tc and util-linux's taskset;
# installed only where missing (apt-get; needs root).
.PHONY: netns-tools
netns-tools:
	@command -v ip >/dev/null 2>&1 && command -v tc >/dev/null 2>&1 || \
		{ apt-get update && apt-get install -y iproute2; }
	@command -v taskset >/dev/null 2>&1 || { apt-get update && apt-get install -y util-linux; }

$(STAMP): requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade "pip<25" "setuptools<70" wheel
	$(PIP) install -r requirements.txt
	touch $@

# Horovod must compile against the TensorFlow that runs it: no build isolation.
$(HVD_STAMP): $(STAMP)
	$(PIP) install cmake
	HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
	HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_CPU_OPERATIONS=GLOO \
	CMAKE_POLICY_VERSION_MINIMUM=3.5 MAKEFLAGS=-j2 \
	PATH=$(abspath $(VENV))/bin:$$PATH \
	$(PIP) install --no-build-isolation horovod==0.28.1
	$(PY) -c "import horovod.tensorflow as hvd; assert hvd.gloo_built(), 'horovod built without gloo'"
	touch $@

# Build the custom-op library in place and install the package in editable mode.
ops: $(STAMP)
	$(PIP) install --no-build-isolation --no-deps -e .
	$(PY) setup.py build_ext --inplace

# The whole suite; multi-process Horovod tests carry their own timeouts, and every test
# is bounded by pytest-timeout so a hang fails instead of blocking CI.
test: setup
	$(PY) -m pytest -q -rs --timeout=900 tests

# The main job: DLRM on Criteo-profile synthetic data (teacher labels), NP workers;
# trains, evaluates, checkpoints and exports under runs/main (started afresh each time).
RUN_DIR ?= runs/main
TRAIN_ARGS ?= --model dlrm --data synthetic --steps 300 --batch-size 1024
train: setup
	rm -rf $(RUN_DIR)
	$(VENV)/bin/horovodrun -np $(NP) --gloo -H localhost:$(NP) $(PY) -m tf_fusedemb.train \
		$(TRAIN_ARGS) --checkpoint-dir $(RUN_DIR)/ckpt --export-dir $(RUN_DIR)/export \
		--log-dir $(RUN_DIR)/tensorboard

smoke: setup
	$(VENV)/bin/horovodrun -np $(NP) --gloo -H localhost:$(NP) $(PY) examples/smoke_fused_lookup.py

bench: setup
	$(PY) -m tf_fusedemb.benchmarks.ops --json

clean:
	rm -rf build tf_fusedemb/_fusedemb_ops.so *.egg-info
