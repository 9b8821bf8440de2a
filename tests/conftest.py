"""Shared pytest setup: Keras 2 for TF, quiet logs, paths of the repository and data."""
import os
import pathlib

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402

try:  # property tests (tests/test_hostile_*.py): deterministic, no example database, no deadline
    from hypothesis import settings
    settings.register_profile("ci", derandomize=True, database=None, deadline=None,
                              print_blob=True)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
except ImportError:  # the property tests skip themselves without hypothesis
    pass

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
TFRA_MARKER = ("tfra: needs TensorFlow Recommenders-Addons, installed on the tf216 stack only "
               "(docs/guide/stacks.md); the other stacks run `-m 'not tfra'`")


# `make test` runs the suite on 3 pytest-xdist workers (`-n 3 --dist loadgroup`). The tests
# of these files run one after another on one worker: they build emulated hosts (network
# namespaces and their subnets), run `make` in the checkout, pin ranks to cores, or assert
# how long a wait took, so two of them at once would share what they need alone.
SERIAL_FILES = frozenset({
    "test_benchmark_inference.py", "test_benchmark_pipeline.py", "test_cluster.py",
    "test_distributed_inference_serve.py", "test_hierarchical_exchange.py",
    "test_horovod_smoke.py", "test_killed_workers.py", "test_make_train_resume.py",
    "test_multihost.py", "test_pinned_launch.py", "test_pipeline_timeline.py",
    "test_readme.py", "test_tiered_storage.py", "test_watchdog_end.py", "test_bls_alltoallv.py",
    "test_distributed_test_case.py"})


def pytest_configure(config):
    config.addinivalue_line("markers", TFRA_MARKER)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the group markers
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in SERIAL_FILES:
            item.add_marker(pytest.mark.xdist_group("serial"))




def _stack():
    """The Makefile's STACK of the TensorFlow running the tests ("tf216", "tf221"): a test
    that runs `make` passes it, so that make uses this stack's venv whatever the default."""
    from importlib.metadata import version  # pylint: disable=import-outside-toplevel
    return "tf" + "".join(version("tensorflow").split(".")[:2])


STACK = _stack()
DEFAULT_STACK = "tf221"  # the Makefile's default STACK
# That stack's venv and main-job run directory (the Makefile's VENV and RUN_DIR).
STACK_VENV = ".venv" if STACK == DEFAULT_STACK else f".venv-{STACK}"
STACK_RUN_DIR = "runs/main" if STACK == DEFAULT_STACK else f"runs/main-{STACK}"
TFRA_NAMES = ("tfra", "dynamic")  # the TFRA backend: its storage name, its table's kind


def storage_params(storages):
    """The storage backends as pytest parameters, the TFRA backend's marked ``tfra``."""
    return [pytest.param(s, marks=pytest.mark.tfra) if s in TFRA_NAMES else s for s in storages]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"


@pytest.fixture
def shared_data():
    """Path of ../shared/data; skips the test with a message when it is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real data samples not found at {SHARED_DATA}")
    return SHARED_DATA
