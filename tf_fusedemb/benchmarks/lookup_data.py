"""Batches of the lookup benchmark: synthetic Criteo-like rows or the real Criteo TSV
(``read_criteo``).

Every rank builds the same global batches and takes its own contiguous slice, so the
variants (and the ranks) see exactly the same samples in the same order.
"""
import pathlib

import numpy as np

from tf_fusedemb.data.criteo import CRITEO_CATEGORICAL as CATEGORICAL  # noqa: F401 (re-export)
from tf_fusedemb.data.criteo import CRITEO_DENSE as DENSE
from tf_fusedemb.data.criteo import dense_log1p
from tf_fusedemb.data.criteo import read_criteo  # noqa: F401 (the one Criteo parser)
from tf_fusedemb.data.synthetic import generate_criteo_like

# The real Criteo Kaggle sample next to the repository (8000 lines), where present.
DEFAULT_CRITEO = (pathlib.Path(__file__).resolve().parents[3] / "shared" / "data" /
                  "criteo-kaggle-sample" / "train.txt")


def make_batches(columns, batch_size, num_ranks, rank, num_batches):
    """``num_batches`` per-rank batches cycled through ``columns``' rows.

    Global batch t is rows [t*G, (t+1)*G) (mod the row count), G = batch_size * num_ranks;
    this rank takes rows [rank*B, (rank+1)*B) of it.
    Returns a list of (x, y) numpy pairs: x = {"C1".."C26": int64[B], "dense": float32[B, 13]
    = log1p(max(I, 0))}, y = float32[B, 1].
    """
    n = len(columns["label"])
    g = batch_size * num_ranks
    dense_all = dense_log1p(np.stack([columns[d] for d in DENSE], 1))
    batches = []
    for t in range(num_batches):
        rows = (np.arange(t * g + rank * batch_size, t * g + (rank + 1) * batch_size)) % n
        x = {c: columns[c][rows].astype(np.int64) for c in CATEGORICAL}
        x["dense"] = dense_all[rows].astype(np.float32)
        batches.append((x, columns["label"][rows].astype(np.float32).reshape(-1, 1)))
    return batches


def synthetic_columns(batch_size, num_ranks, num_batches, seed=0):
    """Enough synthetic rows for ``num_batches`` distinct global batches."""
    return generate_criteo_like(batch_size * num_ranks * num_batches, seed)
