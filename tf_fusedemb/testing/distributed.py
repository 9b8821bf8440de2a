"""``DistributedTestCase``: tf.test.TestCase helpers to check a model on N Horovod ranks
against one process, the way this project checks its own.

    class MyModelTest(DistributedTestCase):
        def test_two_ranks(self):
            self.assertEquivalentToSingleProcess(build_compiled_model, load_data, num_ranks=2)

``run_ranks(fn, N)`` starts N Gloo ranks on localhost (as ``horovodrun -np N --gloo``),
calls ``fn(*args)`` on every rank and returns the N results in rank order; the job is
killed and the test fails with the workers' output when it exceeds its timeout (a
collective that never meets would otherwise hang the suite). ``fn`` and the values passed and returned travel with
cloudpickle (installed with Horovod): module-level functions of an importable module (a
test file, with the test process's ``sys.path``) or closures.
"""
import io
import os
import pickle
import sys
import tempfile
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf
import tf_keras

from tf_fusedemb.comm import get_communicator
from tf_fusedemb.testing.cluster.errors import ClusterTimeout
from tf_fusedemb.testing.cluster.forkserver import SHARED_FORK_SERVERS, ForkServers
from tf_fusedemb.testing.cluster.launcher import run_local_job

__all__ = ["BatchLosses", "DistributedTestCase", "fit_on_this_rank", "rank_bounds",
           "rank_dataset", "run_local_ranks"]

DEFAULT_TIMEOUT_S = 600
# The environment of every rank a test starts (the caller's env= wins). Horovod's background
# thread wakes every HOROVOD_CYCLE_TIME ms (default 1) to negotiate with the other ranks,
# busy or idle: on a machine with few cores that takes ~10% of a core per rank from the
# ranks' own work. At 5 ms a 2-rank pipelined job of 32 steps took 12% less CPU and 9% less
# wall time on 2 cores, with the same results: the library's collectives are matched and
# grouped by name, not by when they arrive.
RANK_ENV = {"HOROVOD_CYCLE_TIME": "5"}


def rank_bounds(num_rows: int, shares: Sequence[int], rank: int) -> List[Tuple[int, int]]:
    """[(lo, hi)] rows ``rank`` feeds in each global batch of sum(shares) rows: rank r takes
    the r-th share of every global batch (the last batch may leave a rank empty), so the
    ranks' batches concatenated in rank order are Keras's batches of one process."""
    size = sum(shares)
    offset = sum(shares[:rank])
    return [(min(s + offset, num_rows), min(s + offset + shares[rank], num_rows))
            for s in range(0, num_rows, size)]


def rank_dataset(arrays, bounds: Sequence[Tuple[int, int]]) -> tf.data.Dataset:
    """tf.data batches of ``arrays`` (a nest of numpy arrays [n, ...]) cut at ``bounds``,
    empty batches included."""
    lo, hi = (np.array([b[i] for b in bounds], np.int64) for i in (0, 1))
    tensors = tf.nest.map_structure(tf.constant, arrays)
    return tf.data.Dataset.from_tensor_slices((lo, hi)).map(
        lambda a, b: tf.nest.map_structure(lambda t: t[a:b], tensors))


class BatchLosses(tf_keras.callbacks.Callback):
    """Records the ``loss`` log of every training batch (what a user's callback sees)."""

    def __init__(self):
        super().__init__()
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))


def fit_on_this_rank(model_fn: Callable, data_fn: Callable, batch_size: int, epochs: int,
                     num_ranks: int = 1, rank: int = 0) -> Dict[str, Any]:
    """Builds ``model_fn()`` (compiled), fits it on this rank's share of every global batch of
    ``data_fn()`` = (x, y) or (x, y, sample_weight) and predicts the whole x.

    Returns:
      {"history": {name: [per epoch]}, "batch_losses": [per batch], "predictions":
      float[n, ...]}.
    """
    data = tuple(data_fn())
    model = model_fn()
    callback = BatchLosses()
    num_rows = len(tf.nest.flatten(data[1])[0])
    shares = [batch_size // num_ranks + (r < batch_size % num_ranks) for r in range(num_ranks)]
    train = rank_dataset(data, rank_bounds(num_rows, shares, rank))
    history = model.fit(train, epochs=epochs, verbose=0, callbacks=[callback])
    # Every rank predicts all rows (same number of steps everywhere: the lookups are collective).
    predictions = model.predict(data[0], batch_size=batch_size, verbose=0)
    return {"history": history.history, "batch_losses": callback.losses,
            "predictions": np.asarray(predictions)}


def _rank_fit(model_fn, data_fn, batch_size, epochs):
    """One rank of assertEquivalentToSingleProcess."""
    comm = get_communicator()
    return fit_on_this_rank(model_fn, data_fn, batch_size, epochs, comm.size, comm.rank)


def run_local_ranks(command: Sequence[str], num_ranks: int, timeout: float,
                    env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None,
                    fork_servers: Optional[ForkServers] = SHARED_FORK_SERVERS) -> str:
    """Runs ``command`` on ``num_ranks`` Gloo ranks of this host (``run_local_job``, as
    ``horovodrun -np N --gloo -H localhost:N`` would) with ``RANK_ENV``, C++ logs at level 2
    and tf_keras, under ``env`` (which wins); returns their output, prefixed as horovodrun
    prefixes it. Ranks of a Python command are forked from ``fork_servers``' interpreters
    where their environment allows (None: each rank a fresh process).

    Raises:
      AssertionError: a rank failed, or the job ran past ``timeout`` seconds (every rank
        is then killed); the message ends with the output's last lines.
    """
    output = io.StringIO()
    full_env = {**RANK_ENV, "TF_CPP_MIN_LOG_LEVEL": "2", "TF_USE_LEGACY_KERAS": "1",
                **(env or {})}
    try:
        result = run_local_job(command, num_ranks, env=full_env, cwd=cwd, timeout=timeout,
                               output=output, fork_servers=fork_servers)
    except ClusterTimeout:
        raise AssertionError(f"{num_ranks}-rank job timed out after {timeout}s (a collective "
                             f"that never met?); output:\n{output.getvalue()[-6000:]}") from None
    if result.returncode != 0:
        raise AssertionError(f"{num_ranks}-rank job failed: rank {result.failed_rank} exited "
                             f"{result.returncode}; output:\n{output.getvalue()[-6000:]}")
    return output.getvalue()


class DistributedTestCase(tf.test.TestCase):
    """tf.test.TestCase with multi-rank helpers (see the module docstring).

    Attributes:
      timeout: seconds a ``run_ranks`` job may take before it is killed (a hang fails).
    """

    timeout = DEFAULT_TIMEOUT_S

    def run_ranks(self, fn: Callable, num_ranks: int = 2, args: Sequence = (),
                  timeout: Optional[float] = None, env: Optional[Dict[str, str]] = None) -> list:
        """``fn(*args)`` on ``num_ranks`` local Gloo ranks (``run_local_job``); the results in rank
        order. Fails the test on a non-zero exit, a rank without a result or the timeout."""
        import cloudpickle  # optional: comes with Horovod  pylint: disable=import-outside-toplevel
        if int(num_ranks) < 1:
            raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
        with tempfile.TemporaryDirectory(prefix="fusedemb_ranks_") as work:
            job = os.path.join(work, "job.pkl")
            with open(job, "wb") as f:
                cloudpickle.dump((fn, tuple(args)), f)
            out = self._launch(job, work, int(num_ranks), timeout or self.timeout, env or {})
            results = []
            for rank in range(int(num_ranks)):
                path = os.path.join(work, f"rank{rank}.pkl")
                if not os.path.exists(path):
                    self.fail(f"rank {rank} returned no result; output:\n{out[-4000:]}")
                with open(path, "rb") as f:
                    results.append(pickle.load(f))
        return results

    def _launch(self, job, work, num_ranks, timeout, env) -> str:
        """Runs the rank workers of ``job``; returns their output (``run_local_ranks``)."""
        return run_local_ranks(
            [sys.executable, "-m", "tf_fusedemb.testing.rank_worker", job, work], num_ranks,
            timeout, env={"PYTHONPATH": os.pathsep.join(p for p in sys.path if p), **env})

    def assertEquivalentToSingleProcess(self, model_fn: Callable, data_fn: Callable,
                                        num_ranks: int = 2, batch_size: int = 32,
                                        epochs: int = 2, reference_fn: Optional[Callable] = None,
                                        rtol: float = 1e-5, atol: float = 1e-6,
                                        timeout: Optional[float] = None):
        """Training on ``num_ranks`` ranks equals training on one process.

        Each rank builds ``model_fn()`` (a compiled FusedModel; the same on every rank) and
        fits its share of every global batch of ``batch_size`` rows of ``data_fn()`` = (x,
        y[, sample_weight]) numpy arrays; the reference fits ``reference_fn()`` (default
        ``model_fn()``; e.g. the plain tf_keras model it was converted from) on the global
        batches in this process. Asserts equal per-epoch history (loss and metrics), per-batch
        losses and predictions of all rows after training, and that the ranks agree.
        Returns the reference's and rank 0's results.
        """
        ranks = self.run_ranks(_rank_fit, num_ranks, (model_fn, data_fn, batch_size, epochs),
                               timeout)
        want = fit_on_this_rank(reference_fn or model_fn, data_fn, batch_size, epochs)
        for rank, got in enumerate(ranks):
            msg = f"rank {rank} of {num_ranks} vs one process"
            self.assertEqual(sorted(got["history"]), sorted(want["history"]), msg)
            for key, values in want["history"].items():
                self.assertAllClose(got["history"][key], values, rtol=rtol, atol=atol,
                                    msg=f"{msg}: history {key}")
            self.assertAllClose(got["batch_losses"], want["batch_losses"], rtol=rtol, atol=atol,
                                msg=f"{msg}: per-batch losses")
            self.assertAllClose(got["predictions"], want["predictions"], rtol=rtol, atol=atol,
                                msg=f"{msg}: predictions")
        return want, ranks[0]
