"""Quiet, conventional output: drops the known noise TensorFlow and TFRA print on a CPU
machine, and nothing else. Opt-in: :func:`install`, called before TensorFlow is imported.

``import tf_fusedemb`` does none of this (it sets no environment variable) and never touches
file descriptor 2.
The project's commands (``python -m tf_fusedemb.train``, ``serve``, the benchmarks, the
examples, ``tf_fusedemb.testing``'s rank workers) call :func:`install` first. It sets:

* environment defaults (a user's own setting wins): ``TF_USE_LEGACY_KERAS=1`` (tf.keras is
  Keras 2, which the TFRA baselines need; ``install(legacy_keras=False)`` leaves it alone,
  for a Keras 3 program) and ``TF_CPP_MIN_LOG_LEVEL=2`` (C++ INFO and WARNING lines such as "Could not find cuda
  drivers", "oneDNN custom operations are on");
* the three "Unable to register cuFFT/cuDNN/cuBLAS factory" ERROR lines of TensorFlow
  2.16's wheel. Where they come from: libtensorflow_cc.so.2 and libtensorflow_framework.so.2
  both carry XLA's CUDA plugin registrations, and the second library's static initialisers
  log "already registered" with LOG(ERROR) while ``import tensorflow`` loads them (also on a
  CPU machine; harmless). ``TF_CPP_MIN_LOG_LEVEL=2`` lets ERROR lines through, and 3 would
  hide every later C++ error too: TensorFlow reads the level once, at the process's first
  C++ log line (so it cannot be raised for the import alone). Hence the first
  ``import tensorflow`` after :func:`install` runs with file descriptor 2 captured and
  every other line written back (:func:`filter_stderr_fd`);
* TensorFlow 2.21's "failed call to cuInit: ... UNKNOWN ERROR (303)" line, which device
  discovery logs on a machine without a CUDA driver (at the first op, not at the import):
  the filtered import also runs the discovery, so that one line is dropped there and every
  later C++ error still arrives;
* TFRA's import-time deprecation notices ("dynamic_embedding.GraphKeys has already been
  deprecated", " _SingleDeviceSaver removed after tf version 2.15", the pkg_resources
  DeprecationWarning): dropped by message, scoped to that import or to the exact text.

A launcher that imports TensorFlow itself before starting the ranks prints the three lines
from its own process: horovodrun's Gloo check imports ``horovod.tensorflow`` in a forked
child that mutes Python's ``sys.stderr`` but not file descriptor 2. Run the launcher with
C++ logs off and the ranks with the usual level, as ``make train`` and ``make smoke`` do
(:func:`launcher_command` builds that command line)::

    TF_CPP_MIN_LOG_LEVEL=3 horovodrun -np 2 --gloo -H localhost:2 \\
        env TF_CPP_MIN_LOG_LEVEL=2 python script.py

Nothing here imports TensorFlow. Importing TensorFlow BEFORE :func:`install` bypasses the
import filter (the environment defaults then also come too late).
"""
import contextlib
import importlib.abc
import importlib.util
import io
import logging
import os
import re
import sys
import tempfile
import warnings
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

__all__ = ["ENV_DEFAULTS", "KERAS_ENV_DEFAULT", "filter_stderr_fd", "install",
           "launcher_command", "set_keras_default"]

KERAS_ENV_DEFAULT = {"TF_USE_LEGACY_KERAS": "1"}  # the project's commands (TFRA needs it)
ENV_DEFAULTS = dict(KERAS_ENV_DEFAULT, TF_CPP_MIN_LOG_LEVEL="2")
# C++ lines of `import tensorflow` that say nothing on any machine (see module docstring).
# TF 2.21 (docs/guide/stacks.md) logs its import-time INFO lines before absl's logging is
# initialised, where TF_CPP_MIN_LOG_LEVEL does not apply yet: the same lines (oneDNN, no CUDA
# driver, CPU instructions) that the level hides on TF 2.16, dropped by their exact text.
TF_IMPORT_NOISE = re.compile(
    rb"Unable to register cu(FFT|DNN|BLAS) factory: Attempting to "
    rb"register factory for plugin cu(FFT|DNN|BLAS) when one has already"
    rb"|^WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    rb"|^I0000 [0-9:. ]+ +\d+ (port\.cc:\d+\] oneDNN custom operations are on"
    rb"|cudart_stub\.cc:\d+\] Could not find cuda drivers on your machine"
    rb"|cpu_feature_guard\.cc:\d+\] This TensorFlow binary is optimized)"
    rb"|^To enable the following instructions: .* rebuild TensorFlow with the appropriate"
    rb"|cuda_platform\.cc:\d+\] failed call to cuInit: INTERNAL: CUDA error: Failed call to "
    rb"cuInit: UNKNOWN ERROR \(303\)$")
TFRA_PRINT_NOISE = " _SingleDeviceSaver removed after tf version 2.15"
TFRA_LOG_NOISE = "dynamic_embedding.GraphKeys has already been deprecated"


def set_keras_default() -> None:
    """``TF_USE_LEGACY_KERAS=1`` unless set (the project's own commands, whose TFRA
    baselines need tf.keras to be Keras 2; a library import never sets it)."""
    for key, value in KERAS_ENV_DEFAULT.items():
        os.environ.setdefault(key, value)


def launcher_command(command: Sequence[str], env: Optional[Mapping[str, str]] = None
                     ) -> Tuple[List[str], Dict[str, str]]:
    """``(argv, environment)`` for a launcher that imports TensorFlow itself (horovodrun):
    the launcher runs with C++ logs off, the program it starts with the level it would
    have had (``env``'s, default 2; ``env`` defaults to this process's environment).

    ``command`` holds one ``"--"`` between the launcher's part and the program's:
    ``[horovodrun, -np, 2, ..., "--", python, script.py]`` becomes
    ``[horovodrun, -np, 2, ..., env, TF_CPP_MIN_LOG_LEVEL=2, python, script.py]``."""
    full = dict(os.environ if env is None else env)
    split = list(command).index("--")
    level = full.get("TF_CPP_MIN_LOG_LEVEL", "2")
    full["TF_CPP_MIN_LOG_LEVEL"] = "3"
    argv = list(command[:split]) + ["env", f"TF_CPP_MIN_LOG_LEVEL={level}"] + \
        list(command[split + 1:])
    return argv, full


def install(legacy_keras: bool = True) -> None:
    """Environment defaults, log/warning filters and the one-shot import filters
    (idempotent). Call it before TensorFlow is imported (see the module docstring).
    ``legacy_keras``: also default ``TF_USE_LEGACY_KERAS=1`` (tf.keras = Keras 2)."""
    for key, value in ENV_DEFAULTS.items():
        if legacy_keras or key not in KERAS_ENV_DEFAULT:
            os.environ.setdefault(key, value)
    logger = logging.getLogger("tensorflow")  # the logger TF's tf_logging writes to
    if not any(isinstance(f, _DropMessages) for f in logger.filters):
        logger.addFilter(_DropMessages(TFRA_LOG_NOISE))
    warnings.filterwarnings("ignore", message="pkg_resources is deprecated as an API",
                            category=DeprecationWarning)
    if not any(isinstance(f, _QuietImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _QuietImport())


@contextlib.contextmanager
def filter_stderr_fd(pattern: "re.Pattern[bytes]"):
    """Captures file descriptor 2 (C++ logs) for the block; then writes back every line
    that does not match ``pattern`` (all of them if the block raises)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        failed = True
        try:
            yield
            failed = False
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            for line in capture:
                if failed or not pattern.search(line):
                    os.write(2, line)


@contextlib.contextmanager
def _filter_stdout(line: str):
    """Python-level stdout of the block, minus lines equal to ``line``."""
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer):
            yield
    finally:
        sys.stdout.write("".join(l for l in buffer.getvalue().splitlines(True)
                                 if l.rstrip("\n") != line))


class _DropMessages(logging.Filter):
    """Drops log records whose message starts with one known text."""

    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record):
        return not str(record.msg).startswith(self.prefix)


def _import_tensorflow_quietly(load: Callable[[], None]) -> None:
    """Runs TensorFlow's import, then its device discovery, under the import filter.

    Discovery (TensorFlow's first op or device query, not the import) calls cuInit; on a
    machine without a CUDA driver that logs one ERROR line (error 303) from C++. Querying
    the devices here, under the filter, drops that line and nothing else: a later C++ error
    still reaches file descriptor 2. Discovery runs once per process anyway, so this only
    moves its cost (under a millisecond on a CPU machine) to the import.
    """
    with filter_stderr_fd(TF_IMPORT_NOISE):
        load()
        sys.modules["tensorflow"].config.list_physical_devices()


def _import_tfra_quietly(load: Callable[[], None]) -> None:
    """TFRA's import with its known print dropped."""
    with _filter_stdout(TFRA_PRINT_NOISE):
        load()


_FILTERS = {"tensorflow": _import_tensorflow_quietly,
            "tensorflow_recommenders_addons": _import_tfra_quietly}


class _QuietImport(importlib.abc.MetaPathFinder):
    """Runs the first import of each module in ``_FILTERS`` under its filter."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _FILTERS or fullname in sys.modules:
            return None
        sys.meta_path.remove(self)  # find the real spec without coming back here
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _FilteredLoader(spec.loader, _FILTERS[fullname])
        return spec


class _FilteredLoader(importlib.abc.Loader):
    """The module's own loader, with ``exec_module`` run under a filter."""

    def __init__(self, loader, run_filtered: Callable[[Callable[[], None]], None]):
        self._loader, self._run_filtered = loader, run_filtered

    def __getattr__(self, name):  # get_resource_reader, is_package, ...: the real loader's
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._run_filtered(lambda: self._loader.exec_module(module))
