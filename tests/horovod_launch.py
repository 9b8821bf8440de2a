"""Launching multi-process Horovod jobs from tests, with a timeout so a hang fails.

``PRELOADER`` is this test process's (one pytest-xdist worker's) ``testing.preload``
servers: the jobs of every test here fork their ranks after TensorFlow's import instead of
importing it again in each rank, where the command and environment allow (otherwise they
run as plain processes). Its servers start with the first job that uses them and end
with this process.
"""
import atexit
import os
import sys

from conftest import REPO_ROOT
from tf_fusedemb.testing.distributed import run_local_ranks
from tf_fusedemb.testing.preload import Preloader

HOROVODRUN = os.path.join(os.path.dirname(sys.executable), "horovodrun")
# The ranks' environment outside Horovod's variables: run_local_ranks's over this process's.
PRELOADER = Preloader({**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "TF_USE_LEGACY_KERAS": "1"})
atexit.register(PRELOADER.close)


def horovodrun(script_args, num_proc, timeout=300, preloaded=True):
    """Runs ``python script_args...`` on ``num_proc`` local Gloo workers in the repository
    (``run_local_ranks``; forked by ``PRELOADER`` unless ``preloaded`` is False); returns
    their output, prefixed as horovodrun prefixes it. Fails the test (AssertionError) on a
    non-zero exit or a timeout."""
    return run_local_ranks([sys.executable] + list(script_args), num_proc, timeout,
                           cwd=str(REPO_ROOT), preloader=PRELOADER if preloaded else None)
