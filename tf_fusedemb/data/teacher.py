"""Learnable labels for synthetic Criteo-shaped data: a fixed "teacher" model.

The profile reproduces each feature's cardinality and skew but not how features relate
to the label, so plain synthetic labels are unlearnable (AUC 0.5). The teacher gives
every (feature, ID) a deterministic effect z ~ N(0, 1) from the library hash, and every
dense feature a fixed weight; label ~ Bernoulli(sigmoid(bias + scale * (sum z / sqrt(F)
+ dense part))), the bias calibrated to the profile's positive rate. The ceiling AUC is
reported by :func:`teacher_auc_ceiling` so training results can be read against it.
"""
from typing import Dict

import numpy as np

from tf_fusedemb.ops import hashing
from tf_fusedemb.data.synthetic import MISSING_ID


def _effects(ids, feature, seed):
    """N(0, 1) effect of each ID of ``feature`` (0 for the missing ID)."""
    salt = hashing.category_tag(f"teacher/{seed}/{feature}")
    bits = hashing.mix64(np.asarray(ids, np.int64).view(np.uint64) ^ salt)
    u1 = ((bits >> np.uint64(40)).astype(np.float64) + 1.0) / 2.0 ** 24
    u2 = ((bits >> np.uint64(16)) & np.uint64(0xFFFFFF)).astype(np.float64) / 2.0 ** 24
    z = np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)
    return np.where(np.asarray(ids) == MISSING_ID, 0.0, z)


def teacher_logits(features: Dict[str, np.ndarray], seed: int = 0, scale: float = 2.0):
    """Logits (without bias) of the teacher for a dict of raw Criteo-like columns."""
    cats = sorted((k for k in features if k.startswith("C")), key=lambda k: int(k[1:]))
    dense = sorted((k for k in features if k.startswith("I")), key=lambda k: int(k[1:]))
    z = sum(_effects(features[c], c, seed) for c in cats) / np.sqrt(max(1, len(cats)))
    rng = np.random.default_rng(seed)
    weights = rng.normal(0.0, 0.3, len(dense))
    d = sum(w * np.log1p(np.maximum(features[k], 0.0)) / 3.0 for w, k in zip(weights, dense))
    return scale * (z + d - np.mean(d) if len(dense) else z)


def teacher_labels(features, seed=0, positive_rate=0.216, scale=2.0):
    """float32[n] labels in {0, 1}; deterministic for (features, seed)."""
    logits = teacher_logits(features, seed, scale)
    lo, hi = -20.0, 20.0
    for _ in range(60):  # bias such that the mean probability is the positive rate
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if np.mean(1 / (1 + np.exp(-(logits + mid)))) < positive_rate \
            else (lo, mid)
    p = 1 / (1 + np.exp(-(logits + lo)))
    u = np.random.default_rng(seed + 1).random(len(p))
    return (u < p).astype(np.float32), p


def teacher_auc_ceiling(probabilities, labels):
    """AUC of the teacher's own probabilities: the best any model can reach."""
    order = np.argsort(probabilities)
    ranks = np.empty(len(order))
    ranks[order] = np.arange(1, len(order) + 1)
    pos = labels > 0.5
    n_pos, n_neg = pos.sum(), (~pos).sum()
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / max(1, n_pos * n_neg))
