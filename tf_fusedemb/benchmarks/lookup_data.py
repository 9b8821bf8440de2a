"""Batches of the lookup benchmark: synthetic Criteo-like rows or the real Criteo TSV.

Every rank builds the same global batches and takes its own contiguous slice, so the
variants (and the ranks) see exactly the same samples in the same order.
"""
import pathlib

import numpy as np

from tf_fusedemb.data.synthetic import MISSING_ID, generate_criteo_like

CATEGORICAL = tuple(f"C{i}" for i in range(1, 27))
DENSE = tuple(f"I{i}" for i in range(1, 14))
# The real Criteo Kaggle sample next to the repository (8000 lines), where present.
DEFAULT_CRITEO = (pathlib.Path(__file__).resolve().parents[3] / "shared" / "data" /
                  "criteo-kaggle-sample" / "train.txt")


def read_criteo_tsv(path, max_rows=None):
    """Criteo TSV (label, I1..I13, C1..C26 hex; empty -> 0 / MISSING_ID) -> column dict
    like ``generate_criteo_like``."""
    labels, dense, cats = [], [], []
    with open(path) as fh:
        for i, line in enumerate(fh):
            if max_rows is not None and i >= max_rows:
                break
            cells = line.rstrip("\n").split("\t")
            if len(cells) < 40:
                continue
            labels.append(float(cells[0] or 0))
            dense.append([float(c) if c else 0.0 for c in cells[1:14]])
            cats.append([int(c, 16) if c else MISSING_ID for c in cells[14:40]])
    if not labels:
        raise ValueError(f"no Criteo rows (40 tab-separated fields) in {path}")
    dense = np.asarray(dense, np.float32)
    cats = np.asarray(cats, np.int64)
    out = {n: cats[:, j].copy() for j, n in enumerate(CATEGORICAL)}
    out.update({n: dense[:, j].copy() for j, n in enumerate(DENSE)})
    out["label"] = np.asarray(labels, np.float32)
    return out


def make_batches(columns, batch_size, num_ranks, rank, num_batches):
    """``num_batches`` per-rank batches cycled through ``columns``' rows.

    Global batch t is rows [t*G, (t+1)*G) (mod the row count), G = batch_size * num_ranks;
    this rank takes rows [rank*B, (rank+1)*B) of it.
    Returns a list of (x, y) numpy pairs: x = {"C1".."C26": int64[B], "dense": float32[B, 13]
    = log1p(max(I, 0))}, y = float32[B, 1].
    """
    n = len(columns["label"])
    g = batch_size * num_ranks
    dense_all = np.log1p(np.maximum(np.stack([columns[d] for d in DENSE], 1), 0.0))
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
