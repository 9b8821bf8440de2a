# tf_fusedemb: one-command setup on a fresh machine (see README.md).
# Installs a pinned stack (docs/guide/stacks.md) into its own virtual environment, builds
# Horovod from source with Gloo, builds the custom-op library and installs the package
# (editable).
SHELL := /bin/bash

# The stack, chosen by one variable (docs/guide/stacks.md):
#   STACK=tf221 (default): TensorFlow 2.21 + tf_keras 2.21 on Python 3.12 (the Python it is
#     tested with), no TFRA, in .venv; Horovod 0.28.1 patched by
#     patches/horovod-0.28.1-tf2.21.patch (TF >= 2.20 breaks its unpatched build).
#   STACK=tf216: TensorFlow 2.16.2 + tf_keras 2.16 + TFRA 0.8.1 (built for TF 2.16 only), the
#     stack of ../shared/ENVIRONMENT.md, in .venv-tf216: kept for what needs TFRA (the
#     `tfra` tests, the benchmarks' TFRA baselines).
# Each stack has its own venv, requirements file and op library (named after TF's version),
# so switching between them rebuilds nothing. Set on make's command line only (a plain
# assignment: an environment variable named STACK does not switch the stack).
STACK := tf221
ifeq ($(STACK),tf221)
VENV := .venv
REQUIREMENTS := requirements.txt
PYTHON_WANTED := 3.12
HVD_PATCH := patches/horovod-0.28.1-tf2.21.patch
else ifeq ($(STACK),tf216)
VENV := .venv-tf216
REQUIREMENTS := requirements-tf216.txt
PYTHON ?= python3
HVD_PATCH :=
else
$(error STACK=$(STACK) is not a stack: use tf221 (default) or tf216 (docs/guide/stacks.md))
endif
ifdef PYTHON_WANTED
# The interpreter: python$(PYTHON_WANTED) if it runs (a pyenv shim on the PATH may not: it
# fails unless that version is selected), else pyenv's own build of it; else one line saying
# what to install. Evaluated only when the venv is created.
PY_NAME = python$(PYTHON_WANTED)
PYTHON ?= $$(for p in $(PY_NAME) \
	"$$(pyenv root 2>/dev/null)"/versions/$(PYTHON_WANTED)*/bin/$(PY_NAME) \
	$$HOME/.pyenv/versions/$(PYTHON_WANTED)*/bin/$(PY_NAME); do \
	"$$p" -c 'import sys; assert sys.version_info[:2] == ($(subst .,$(comma),$(PYTHON_WANTED)))' \
	2>/dev/null && { echo "$$p"; break; }; done)
endif
comma := ,
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.stack-installed
HVD_STAMP := $(VENV)/.horovod-installed
export TF_USE_LEGACY_KERAS := 1
export TF_CPP_MIN_LOG_LEVEL := 2

.PHONY: setup ops typecheck docs test train smoke bench clean
# What a build keeps on this machine for the next setup (a fresh clone, CI, the other stack):
# Horovod's wheels (below), mypy's cache, and the op library (setup.py keeps it itself).
CACHE_DIR := $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/tf_fusedemb
NP ?= 2

# The last step of setup byte-compiles the package (its __pycache__ directories): where
# PYTHONDONTWRITEBYTECODE is set, as in many CI images, Python would otherwise compile every
# module of the package again in each process it starts, every rank of every job included
# (0.15 s of CPU a process on a 2-core VM; the suite starts about 260 processes that import
# TensorFlow). A module edited afterwards is compiled from its source as before: Python
# checks each .pyc against its source's modification time and size.
setup: netns-tools mpi-tools rocksdb-lib $(HVD_STAMP) ops
	$(PY) -m compileall -q -j0 tf_fusedemb

# Distributed inference (tf_fusedemb.serve, comm/bls_alltoallv.py) runs under Open MPI's
# mpirun with mpi4py (requirements.txt); installed only where missing (apt-get; needs root).
.PHONY: mpi-tools
mpi-tools:
	@command -v mpirun >/dev/null 2>&1 && command -v mpicc >/dev/null 2>&1 || \
		{ apt-get update && apt-get install -y openmpi-bin libopenmpi-dev; }

# The storage engine's checkpoints are RocksDB databases: the op library links the
# distribution's RocksDB (custom_ops/rocksdb_checkpoint.cc; -lrocksdb in setup.py),
# installed only where missing (apt-get; needs root).
.PHONY: rocksdb-lib
rocksdb-lib:
	@test -f /usr/include/rocksdb/db.h || { apt-get update && apt-get install -y librocksdb-dev; }

# Emulated hosts (tf_fusedemb.testing.cluster) need iproute2's ip/tc and util-linux's taskset;
# installed only where missing (apt-get; needs root).
.PHONY: netns-tools
netns-tools:
	@command -v ip >/dev/null 2>&1 && command -v tc >/dev/null 2>&1 || \
		{ apt-get update && apt-get install -y iproute2; }
	@command -v taskset >/dev/null 2>&1 || { apt-get update && apt-get install -y util-linux; }

$(STAMP): $(REQUIREMENTS)
	@py="$(PYTHON)"; [ -n "$$py" ] || { echo "STACK=$(STACK) needs Python $(PYTHON_WANTED): \
	install it (pyenv install $(PYTHON_WANTED)) and rerun"; exit 1; }; \
	echo "creating $(VENV) with $$py"; "$$py" -m venv $(VENV)
	$(PIP) install --upgrade "pip<25" "setuptools<70" wheel
	$(PIP) install -r $(REQUIREMENTS)
	touch $@

# Horovod must compile against the TensorFlow that runs it: no build isolation. It is built
# from the 0.28.1 source release (pip's sdist); a stack that names HVD_PATCH applies it first
# (patches/: what each hunk does and why), so the patch is the only change to that release.
# It compiles without debug information (patches/without-debug-info): about 30% less
# compile time, the same optimised code.
# The wheel it builds is kept in HVD_CACHE under a key of everything the build reads (the
# release, the stack's requirements, the patch, the compiler launcher, Python's version):
# a later setup on this machine (a fresh clone, CI) installs it instead of compiling for
# minutes. A cached wheel that fails the import check is rebuilt. The wheel holds no path
# of the venv (Horovod finds TensorFlow's libraries once TensorFlow is loaded).
HVD_VERSION := 0.28.1
HVD_SRC := build/horovod-$(STACK)
HVD_LAUNCHER := $(abspath patches/without-debug-info)
HVD_CACHE ?= $(CACHE_DIR)/horovod-wheels
HVD_CHECK := import horovod.tensorflow as hvd; assert hvd.gloo_built(), 'horovod built without gloo'
$(HVD_STAMP): $(STAMP) $(HVD_PATCH) patches/without-debug-info
	@key=$$({ echo $(HVD_VERSION) $(STACK); cat $(REQUIREMENTS) $(HVD_PATCH) \
		patches/without-debug-info; $(PY) -c 'import sys; print(sys.version)'; } | \
		sha256sum | cut -c1-16); cached=$(HVD_CACHE)/$$key; \
	if ls $$cached/horovod-*.whl >/dev/null 2>&1 && \
		$(PIP) install --no-deps --force-reinstall $$cached/horovod-*.whl && \
		$(PIP) install $$cached/horovod-*.whl && $(PY) -c "$(HVD_CHECK)"; then \
		echo "horovod: installed the wheel built earlier ($$cached)"; \
	else $(MAKE) --no-print-directory hvd-build STACK=$(STACK) HVD_WHEELS=$$cached; fi
	touch $@

.PHONY: hvd-build
hvd-build:
	$(PIP) install cmake
	rm -rf $(HVD_SRC) && mkdir -p $(HVD_SRC)/wheel
	$(PIP) download --no-binary :all: --no-deps horovod==$(HVD_VERSION) -d $(HVD_SRC)
	tar xzf $(HVD_SRC)/horovod-$(HVD_VERSION).tar.gz -C $(HVD_SRC)
	$(if $(HVD_PATCH),patch -p1 -d $(HVD_SRC)/horovod-$(HVD_VERSION) < $(HVD_PATCH))
	HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
	HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_CPU_OPERATIONS=GLOO \
	CMAKE_POLICY_VERSION_MINIMUM=3.5 MAKEFLAGS=-j2 \
	CMAKE_CXX_COMPILER_LAUNCHER=$(HVD_LAUNCHER) CMAKE_C_COMPILER_LAUNCHER=$(HVD_LAUNCHER) \
	PATH=$(abspath $(VENV))/bin:$$PATH \
	$(PIP) wheel --no-build-isolation --no-deps -w $(HVD_SRC)/wheel \
		$(HVD_SRC)/horovod-$(HVD_VERSION)
	$(PIP) install --no-deps --force-reinstall $(HVD_SRC)/wheel/horovod-*.whl
	$(PIP) install $(HVD_SRC)/wheel/horovod-*.whl
	$(PY) -c "$(HVD_CHECK)"
	@# into the cache whole or not at all: a copy under a temporary name, then a rename
	@if [ -n "$(HVD_WHEELS)" ]; then mkdir -p $(dir $(HVD_WHEELS)) && \
		tmp=$$(mktemp -d $(HVD_WHEELS).tmp.XXXX) && cp $(HVD_SRC)/wheel/horovod-*.whl $$tmp/ && \
		{ rm -rf $(HVD_WHEELS); mv $$tmp $(HVD_WHEELS); } || true; fi

# Build the custom-op library in place and install the package in editable mode.
# The op library is rebuilt (and the package reinstalled, editable) only when its sources,
# setup.py or the stack change, so `make train` / `make test` start the job at once.
# Its name carries TensorFlow's version (setup.py): each stack has its own.
OPS_TF := $(if $(filter tf221,$(STACK)),2.21,2.16)
OPS_SO := tf_fusedemb/_fusedemb_ops-tf$(OPS_TF).so
ops: $(OPS_SO)
$(OPS_SO): $(STAMP) setup.py $(wildcard custom_ops/*.cc custom_ops/*.h) | rocksdb-lib
	mkdir -p build && flock build/.editable-install.lock \
		$(PIP) install --no-build-isolation --no-deps -e .
	$(PY) setup.py build_ext --inplace
	touch $@

# The type checker: mypy (pinned in requirements-typecheck.txt, its own stamp, so changing it
# rebuilds neither the stack nor Horovod) on tf_fusedemb/ with the configuration of mypy.ini.
# Any error fails it; it needs no op library (nor Horovod): under a minute without its cache.
# Its cache is kept in CACHE_DIR, one per stack, so a fresh clone checks again only what
# differs from the last check on this machine (mypy compares each file's size, time and
# hash with its cache): 1.5 s instead of 17 on a 2-core VM.
TYPECHECK_STAMP := $(VENV)/.typecheck-installed
$(TYPECHECK_STAMP): $(STAMP) requirements-typecheck.txt
	$(PIP) install -r requirements-typecheck.txt
	touch $@

typecheck: $(TYPECHECK_STAMP)
	$(PY) -m mypy --cache-dir $(CACHE_DIR)/mypy-$(STACK)

# The documentation site (mkdocs.yml: MkDocs, the Material theme, mkdocstrings for the API
# reference), pinned in requirements-docs.txt with its own stamp, so changing it rebuilds
# neither the stack nor Horovod. Strict: a broken link or anchor, a page missing from the
# navigation or an API reference that does not resolve fails the build. Output: site/.
# mkdocstrings reads the docstrings from the source: no op library, Horovod or TensorFlow.
DOCS_STAMP := $(VENV)/.docs-installed
$(DOCS_STAMP): $(STAMP) requirements-docs.txt
	$(PIP) install -r requirements-docs.txt
	touch $@

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

# The whole suite, after the set-up of both stacks (test-setup, below); multi-process
# Horovod tests carry their own timeouts, and every test is bounded by pytest-timeout so a
# hang fails instead of blocking CI.
# tests/test_docs.py builds the site (strict) and tests/test_readme.py runs the code blocks
# of the README and the guides: the docs requirements are installed first.
# The tests that need TFRA (marked `tfra`, registered in tests/conftest.py) run on the tf216
# stack only, the one that has TFRA: on the default stack, `make test` runs the suite
# without them (deselected by the marker, not skipped), then exactly them on tf216 (the
# pytest-tfra target). `make test STACK=tf216` runs the whole suite on tf216.
# Three pytest-xdist workers on two cores: most tests spend their time in one Python
# thread (tracing, process start-up) or waiting (on ranks, on a deadline a test checks), so
# two workers left an eighth of two cores idle; a third fills it (the default suite on a
# quiet 2-core VM: 984 s against 1,058 s with two, side by side in one session). The tests
# that need the machine alone run one after another on one worker (tests/conftest.py:
# SERIAL_FILES).
TEST_SELECT := $(if $(filter tf216,$(STACK)),,-m "not tfra")
TEST_WORKERS ?= 3
PYTEST_RUN = $(PY) -m pytest -q -rs --timeout=900 -n $(TEST_WORKERS) --dist loadgroup --durations=60
test:
	$(MAKE) --no-print-directory test-setup
	$(PYTEST_RUN) $(TEST_SELECT) tests
	$(if $(filter tf216,$(STACK)),,$(MAKE) STACK=tf216 pytest-tfra)

# Everything the suite needs: the type check (it fails the run before the long suite), the
# docs requirements and this stack's setup, one after another; on the default stack, the
# tf216 stack's setup (for its TFRA tests) at the same time, in the background, its output
# kept in build/tf216-setup.log and printed once it is done. Pip installs spend much of their
# time unpacking and writing files, so the two setups overlap on two cores. The system
# packages are checked first, so only one apt-get ever runs; the editable installs take
# turns (both write tf_fusedemb.egg-info: the ops target's flock).
.PHONY: test-setup system-packages
# The running stack's own targets, in order (its type check, docs requirements, setup).
OWN_SETUP = typecheck $(DOCS_STAMP) setup
test-setup: system-packages
ifeq ($(STACK),tf216)
	$(MAKE) $(OWN_SETUP)
else
	@mkdir -p build; $(MAKE) STACK=tf216 setup > build/tf216-setup.log 2>&1 & other=$$!; \
	$(MAKE) $(OWN_SETUP); mine=$$?; wait $$other; theirs=$$?; \
	echo "--- the tf216 stack's setup (build/tf216-setup.log) ---"; cat build/tf216-setup.log; \
	exit $$(( mine || theirs ))
endif
system-packages: netns-tools mpi-tools rocksdb-lib

# The TF 2.16 stack's share of CI: the tests marked `tfra` (the TFRA backend, the
# benchmarks' TFRA baselines, the checkpoint round trip between the two backends, and the
# 2-rank TFRA save restored onto 1 rank of tests/test_checkpoint.py, the 2-rank job): 48
# tests, about a minute and a half on 2 cores, after its setup. Always on tf216 whatever
# STACK says.
.PHONY: test-tf216 pytest-tfra
test-tf216:
	$(MAKE) STACK=tf216 setup
	$(MAKE) STACK=tf216 pytest-tfra
pytest-tfra:
	$(PYTEST_RUN) -m tfra tests

# The main job: DLRM on Criteo-profile synthetic data (teacher labels), NP workers;
# trains, evaluates, checkpoints and exports under runs/main. Rerunning it resumes from
# the last complete checkpoint there (e.g. after a lost worker: the message says so);
# FRESH=1 starts afresh (removes RUN_DIR first), e.g. after changing the model.
# HOSTS=2 (or more) runs the NP workers on emulated hosts instead (tf_fusedemb.testing.cluster,
# needs root): HOSTS hosts x NP/HOSTS ranks, each host's link LINK_MBIT Mbit/s, e.g.
# `make train HOSTS=2` (2 x 1) or `make train HOSTS=2 NP=4 LINK_MBIT=300` (2 x 2).
# Each stack trains into its own run directory (runs/main on the default stack,
# runs/main-tf216 on tf216): a rerun resumes its own stack's checkpoint, never the other's.
RUN_DIR ?= runs/main$(if $(filter tf221,$(STACK)),,-$(STACK))
TRAIN_ARGS ?= --model dlrm --data synthetic --steps 300 --batch-size 1024
HOSTS ?= 1
LINK_MBIT ?= 1000
ifeq ($(HOSTS),1)
# horovodrun as for `make smoke` (below: the launcher with C++ logs off, the workers at 2).
# Each rank is pinned to its share of the cores, with thread counts to match (as on emulated
# hosts; tf_fusedemb/testing/cluster/pinned.py): on a quiet 2-core machine the main job ran at
# 84k samples/s pinned against 71k unpinned. PIN=0 turns it off for a machine shared
# with other work, where a pinned rank waits for its core (17-19k against 30k at load 4-8).
PIN ?= 1
TRAIN_LAUNCH = $(HOROVODRUN) $(if $(filter 1 yes true,$(PIN)),$(PY) -m tf_fusedemb.testing.cluster.pinned)
else
RANKS_PER_HOST = $(shell echo $$(( $(NP) / $(HOSTS) )))
TRAIN_LAUNCH = $(if $(filter 0,$(shell echo $$(( $(NP) % $(HOSTS) )))),,$(error NP=$(NP) is \
	not a multiple of HOSTS=$(HOSTS)))$(PY) -m tf_fusedemb.testing.cluster --hosts $(HOSTS) \
	--ranks-per-host $(RANKS_PER_HOST) --link-mbit $(LINK_MBIT) --
endif
FRESH ?= 0
# Tests only: `make train TRAIN_FAULT=rank=R,step=S,phase=step|save` makes rank R kill itself
# there (tf_fusedemb.testing.faults wraps the job). Set on make's command line only: a plain
# assignment, so an environment variable of that name is ignored.
TRAIN_FAULT :=
TRAIN_MAIN = $(if $(TRAIN_FAULT),-m tf_fusedemb.testing.faults --fault $(TRAIN_FAULT)) -m tf_fusedemb.train
train: setup
	$(if $(filter 1 yes true,$(FRESH)),rm -rf $(RUN_DIR))
	$(TRAIN_LAUNCH) $(PY) $(TRAIN_MAIN) \
		$(TRAIN_ARGS) --checkpoint-dir $(RUN_DIR)/ckpt --export-dir $(RUN_DIR)/export \
		--log-dir $(RUN_DIR)/tensorboard

# The main job beyond memory: the same DLRM with one more feature, W, of WIDE_IDS distinct
# IDs (train.py --wide-ids: one new ID per sample until the job has seen them all), its
# tables under a DRAM budget of WIDE_BUDGET_MB per rank, the job (every rank and the
# launcher) inside a memory cgroup of WIDE_LIMIT_MB (tf_fusedemb.testing.memory_limit,
# root only), for as many steps as it takes to meet every ID once. It prints the job's
# RESULT (samples/s, eval AUC, the tiers' contents) and a MEMORY_LIMIT line (the cgroup's
# peak, OOM kills). At 50 M IDs the W table alone holds about 7.8 GB of blocks. The same
# job all in DRAM at a size that fits, to set beside it:
#   make train-beyond-memory WIDE_IDS=2000000 WIDE_BUDGET_MB= WIDE_LIMIT_MB=
WIDE_IDS ?= 50000000
WIDE_BATCH ?= 4096
WIDE_BUDGET_MB ?= 256
WIDE_LIMIT_MB ?= 3584
.PHONY: train-beyond-memory
train-beyond-memory: setup
	$(if $(WIDE_LIMIT_MB),$(PY) -m tf_fusedemb.testing.memory_limit --limit-mb $(WIDE_LIMIT_MB) -- env) \
		$(TRAIN_LAUNCH) $(PY) -m tf_fusedemb.train --model dlrm --data synthetic \
		--batch-size $(WIDE_BATCH) --wide-ids $(WIDE_IDS) --eval-rows 20480 \
		--steps $$(( $(WIDE_IDS) / ($(WIDE_BATCH) * $(NP)) + 1 )) \
		$(if $(WIDE_BUDGET_MB),--memory-budget-mb $(WIDE_BUDGET_MB))

# horovodrun's Gloo check imports TensorFlow in a child whose C++ lines (TF 2.16's three
# CUDA-factory errors) Horovod cannot mute: the launcher runs with C++ logs off, the workers
# with the usual level 2 (tf_fusedemb/quiet.py says where the lines come from).
HOROVODRUN = TF_CPP_MIN_LOG_LEVEL=3 $(VENV)/bin/horovodrun -np $(NP) --gloo -H localhost:$(NP) \
	env TF_CPP_MIN_LOG_LEVEL=2
smoke: setup
	$(HOROVODRUN) $(PY) examples/smoke_fused_lookup.py

bench: setup
	$(PY) -m tf_fusedemb.benchmarks.ops --json

# The peer benchmark (optional, not in CI): our DLRM step against TorchRec's CPU path on the
# same batches (tf_fusedemb/benchmarks/peers.py). TorchRec lives in its own environment,
# .venv-peers (Python 3.11, requirements-peers.txt; torchrec itself without dependencies).
PEERS_VENV := .venv-peers
PEERS_PYTHON_WANTED := 3.11
PEERS_STAMP := $(PEERS_VENV)/.installed
.PHONY: peers-env peers
peers-env: $(PEERS_STAMP)
$(PEERS_STAMP): requirements-peers.txt
	@py=$$(for p in python$(PEERS_PYTHON_WANTED) \
		$$HOME/.pyenv/versions/$(PEERS_PYTHON_WANTED)*/bin/python$(PEERS_PYTHON_WANTED); do \
		"$$p" -c 'import sys; assert sys.version_info[:2] == (3, 11)' 2>/dev/null && \
		{ echo "$$p"; break; }; done); \
	[ -n "$$py" ] || { echo "peers-env needs Python $(PEERS_PYTHON_WANTED)"; exit 1; }; \
	"$$py" -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip install -r requirements-peers.txt
	$(PEERS_VENV)/bin/python -m pip install --no-deps torchrec==1.9.2
	touch $@
peers: setup peers-env
	$(PY) -m tf_fusedemb.benchmarks.peers --json

# The op library built with AddressSanitizer + UndefinedBehaviorSanitizer into a separate
# .so (loaded through TF_FUSEDEMB_OPS_LIBRARY), and the op tests run against it (those that
# need TFRA only on the stack that has it, as `make test`). Python and
# TensorFlow are not instrumented: the sanitizer runtimes are preloaded, leak detection is
# off (both leak by design), and any finding aborts the run with a non-zero status; pytest
# captures at the sys level only (--capture=sys), so the sanitizer's report reaches stderr.
SAN_DIR := build/sanitize
SAN_LIB := $(SAN_DIR)/_fusedemb_ops_asan_ubsan.so
SAN_TESTS ?= tests/test_segment_unique.py tests/test_rankwise_sort.py tests/test_category_hash.py \
	tests/test_key_messages.py \
	tests/test_recovery.py tests/test_ops_loading.py tests/test_hostile_ops.py \
	tests/test_engine.py tests/test_engine_stress.py tests/test_tiered_storage.py
# -U__SANITIZE_ADDRESS__: absl (the storage engine's hash index) comes from TensorFlow's
# libtensorflow_framework.so.2, built without sanitizers; under ASan absl's headers add
# "generation" bytes to every swiss table, a layout that copy does not have (a null
# EmptyGeneration() at the first insert). Undefining the macro keeps the layouts equal;
# ASan's instrumentation does not depend on it.
# UBSAN_NO_NULL: GCC 12's UBSan null checks (null, nonnull-attribute,
# returns-nonnull-attribute) make `&function == nullptr` no constant expression, which the
# absl of TensorFlow 2.21 (20250814) needs at compile time (hash_policy_traits.h's
# get_hash_slot_fn): with them no file that uses a flat_hash_map compiles. A null
# dereference still stops an ASan run (SEGV).
UBSAN_NO_NULL := -fno-sanitize=null,nonnull-attribute,returns-nonnull-attribute
SAN_CXXFLAGS := -shared -fPIC -O1 -g -std=c++17 -fsanitize=address,undefined $(UBSAN_NO_NULL) \
	-U__SANITIZE_ADDRESS__ -fno-sanitize-recover=all -fno-omit-frame-pointer -Icustom_ops
SAN_ENV = LD_PRELOAD="$$(g++ -print-file-name=libasan.so):$$(g++ -print-file-name=libubsan.so)" \
	ASAN_OPTIONS=detect_leaks=0:halt_on_error=1:abort_on_error=1:detect_stack_use_after_return=1 \
	UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	TF_FUSEDEMB_OPS_LIBRARY=$(abspath $(SAN_LIB))
TF_FLAGS = $$($(PY) -c "import tensorflow as tf; print(' '.join(tf.sysconfig.get_compile_flags() + \
	tf.sysconfig.get_link_flags() + ['-Wl,-rpath,' + tf.sysconfig.get_lib()]))" 2>/dev/null)
# The storage engine's standalone tests (tests/engine_stress_test.cc: arena arithmetic, a
# model-based test, 8 writer threads + 2 readers upserting 320k keys across many index
# doublings) built and run once under ThreadSanitizer and once under ASan + UBSan (with
# leak detection: nothing else runs in that process).
ENGINE_STRESS := tests/engine_stress_test.cc
ENGINE_STRESS_ARGS ?= 80000 2
ENGINE_SAN_CXXFLAGS := -O1 -g -std=c++17 -fno-omit-frame-pointer -pthread -Icustom_ops
.PHONY: sanitize sanitize-engine
sanitize-engine: $(STAMP)
	@mkdir -p $(SAN_DIR)
	g++ $(ENGINE_SAN_CXXFLAGS) -fsanitize=thread $(ENGINE_STRESS) -o $(SAN_DIR)/engine_stress_tsan $(TF_FLAGS)
	TSAN_OPTIONS=halt_on_error=1:exitcode=66 $(SAN_DIR)/engine_stress_tsan $(ENGINE_STRESS_ARGS)
	g++ $(ENGINE_SAN_CXXFLAGS) -fsanitize=address,undefined $(UBSAN_NO_NULL) -U__SANITIZE_ADDRESS__ \
		-fno-sanitize-recover=all $(ENGINE_STRESS) -o $(SAN_DIR)/engine_stress_asan_ubsan $(TF_FLAGS)
	ASAN_OPTIONS=detect_leaks=1:halt_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
		$(SAN_DIR)/engine_stress_asan_ubsan $(ENGINE_STRESS_ARGS)

# How the storage engine scales with cores (tests/engine_scaling_bench.cc: the update
# against a plain-array floor, the partition's share, lookups per second), standalone: it
# needs TensorFlow's headers and absl only to build, so it runs on any machine with them.
# ENGINE_BENCH_ARGS: rows, thread counts (1,2,4,...), batch, steps.
ENGINE_BENCH_ARGS ?= 50000000
.PHONY: engine-bench
engine-bench: $(STAMP)
	@mkdir -p build
	g++ -O3 -DNDEBUG -std=c++17 -Wall -Wno-sign-compare -pthread -Icustom_ops tests/engine_scaling_bench.cc \
		-o build/engine_scaling_bench $(TF_FLAGS)
	build/engine_scaling_bench $(ENGINE_BENCH_ARGS)

# The SSD tier's CPU per block moved and its hit rate (tests/engine_tier_bench.cc: the same
# Zipf steps on the engine with and without a budget, one thread, process CPU time), with a
# bit-for-bit check of the rows; standalone like engine-bench, plus RocksDB for the store's
# checkpoint code. TIER_BENCH_ARGS: rows, batch, steps, budget fraction, spill directory,
# untimed warm-up steps.
TIER_BENCH_ARGS ?= 200000 2000 200 0.1
.PHONY: tier-bench
tier-bench: $(STAMP) rocksdb-lib
	@mkdir -p build
	g++ -O3 -DNDEBUG -std=c++17 -Wall -Wno-sign-compare -pthread -Icustom_ops tests/engine_tier_bench.cc \
		custom_ops/slot_file_block_store.cc custom_ops/rocksdb_checkpoint.cc \
		-o build/engine_tier_bench -lrocksdb $(TF_FLAGS)
	build/engine_tier_bench $(TIER_BENCH_ARGS)

sanitize: $(STAMP) rocksdb-lib sanitize-engine
	@mkdir -p $(SAN_DIR)
	g++ $(SAN_CXXFLAGS) custom_ops/*.cc -o $(SAN_LIB) \
		$$($(PY) -c "import tensorflow as tf; print(' '.join(tf.sysconfig.get_compile_flags() + tf.sysconfig.get_link_flags()))" 2>/dev/null) \
		-lrocksdb
	$(SAN_ENV) $(PY) -c "from tf_fusedemb.ops import _loader; _loader.load_library(); \
		print('sanitized op library loaded:', _loader.library_path())"
	$(SAN_ENV) $(PY) -m pytest -q -rs -p no:cacheprovider --capture=sys --timeout=900 $(TEST_SELECT) \
		$(SAN_TESTS)

clean:
	rm -rf build site tf_fusedemb/_fusedemb_ops-tf*.so *.egg-info
	find tf_fusedemb -name __pycache__ -type d -prune -exec rm -rf {} +
