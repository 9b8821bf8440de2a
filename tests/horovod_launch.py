"""Launching multi-process Horovod jobs from tests, with a timeout so a hang fails."""
import os
import sys

from conftest import REPO_ROOT
from tf_fusedemb.testing.distributed import run_local_ranks

HOROVODRUN = os.path.join(os.path.dirname(sys.executable), "horovodrun")


def horovodrun(script_args, num_proc, timeout=300):
    """Runs ``python script_args...`` on ``num_proc`` local Gloo workers in the repository
    (``run_local_ranks``); returns their output, prefixed as horovodrun prefixes it. Fails
    the test (AssertionError) on a non-zero exit or a timeout."""
    return run_local_ranks([sys.executable] + list(script_args), num_proc, timeout,
                           cwd=str(REPO_ROOT))
