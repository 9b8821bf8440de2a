"""Launching multi-process Horovod jobs from tests, with a timeout so a hang fails."""
import io
import os
import sys

from conftest import REPO_ROOT
from tf_fusedemb.testing.cluster import ClusterTimeout
from tf_fusedemb.testing.cluster.launcher import run_local_job
from tf_fusedemb.testing.distributed import RANK_ENV

HOROVODRUN = os.path.join(os.path.dirname(sys.executable), "horovodrun")


def horovodrun(script_args, num_proc, timeout=300):
    """Runs ``python script_args...`` on ``num_proc`` local Gloo workers, as
    ``horovodrun -np N --gloo -H localhost:N`` does (``run_local_job``, with the test ranks'
    ``RANK_ENV``); returns their
    output, prefixed as horovodrun prefixes it. Fails the test (AssertionError) on a
    non-zero exit or a timeout."""
    output = io.StringIO()
    try:
        result = run_local_job([sys.executable] + list(script_args), num_proc,
                               env={**RANK_ENV, "TF_CPP_MIN_LOG_LEVEL": "2",
                                    "TF_USE_LEGACY_KERAS": "1"},
                               cwd=str(REPO_ROOT), timeout=timeout, output=output)
    except ClusterTimeout as e:
        raise AssertionError(f"{num_proc} ranks timed out after {timeout}s (a hang?): "
                             f"{' '.join(script_args)}\n{output.getvalue()[-3000:]}") from e
    assert result.returncode == 0, (f"{num_proc} ranks failed: rank {result.failed_rank} "
                                    f"exited {result.returncode}:\n{output.getvalue()[-6000:]}")
    return output.getvalue()
