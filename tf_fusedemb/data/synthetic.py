"""Criteo-shaped synthetic data drawn from a fitted `DatasetProfile` (vectorised numpy).

Per categorical feature, a row is empty (MISSING_ID) with the profile's empty fraction, else it
takes the feature's top value with `top_fraction`, else a Zipf(s) rank in 1..V-1. Ranks become IDs
through a fixed bijection on 63 bits, so IDs are large scrambled non-negative int64 values (hot
IDs are not small integers, and hash-based sharding sees realistic keys), and distinct
(feature, rank) pairs never share an ID. Features are independent of each other and of the label
(the real data has correlated columns, e.g. C3/C12/C16/C21); this is a systems workload, not a
learnable task.

The Zipf model used by the sampler and by `fit_profile` is the same (`zipf_parts`): exact weights
r**-s for ranks r <= HEAD_RANKS, and for the tail the continuous density x**-s on
[HEAD_RANKS + 0.5, V + 0.5) rounded to the nearest rank, so huge vocabularies need no table.
"""
from __future__ import annotations

import functools
from typing import Dict, Optional, Tuple, Union

import numpy as np

from .profile import ID_RANK_BITS, DatasetProfile, load_profile

__all__ = ["MISSING_ID", "DENSE_MISSING", "HEAD_RANKS", "zipf_parts", "scramble_ids",
           "generate_criteo_like", "criteo_like_batch_keys", "synthetic_dataset"]

# An empty categorical value. 0 is a valid key for every table kind (hash tables, modulo
# hashing) so "missing" gets its own embedding as in DLRM preprocessing; scrambled IDs are never 0
# because the bijection maps only 0 to 0 and packed (feature, rank) inputs are never 0.
MISSING_ID = 0
# An empty dense value (the usual "fill with 0" of Criteo preprocessing).
DENSE_MISSING = 0.0
# Ranks sampled from an exact table; beyond this the continuous tail is accurate to ~1e-8 relative.
HEAD_RANKS = 4096

_MASK63 = np.uint64((1 << 63) - 1)


def scramble_ids(x: np.ndarray) -> np.ndarray:
    """Bijection on [0, 2**63): splitmix64's finaliser with every step taken mod 2**63.

    x ^= x >> k keeps x below 2**63 and is invertible; multiplying by an odd constant mod 2**63 is
    invertible; so the whole map is a permutation of the non-negative int64 values with 0 -> 0.

    Args:
      x: uint64[...] or int64[...] values in [0, 2**63).
    Returns:
      int64[...] scrambled values in [0, 2**63).
    """
    z = np.asarray(x).astype(np.uint64) & _MASK63
    with np.errstate(over="ignore"):  # wrap-around multiplication is the point
        z = ((z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK63
        z = ((z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK63
        z = z ^ (z >> np.uint64(31))
    return z.astype(np.int64)


@functools.lru_cache(maxsize=256)
def zipf_parts(s: float, v: int) -> Tuple[np.ndarray, float, float, float]:
    """Unnormalised Zipf(s) over ranks 1..v, split into an exact head and a continuous tail.

    Returns:
      (head_w float64[min(v, HEAD_RANKS)] = r**-s, tail_mass = integral of x**-s over [a, b),
       a = HEAD_RANKS + 0.5, b = v + 0.5). The normaliser is head_w.sum() + tail_mass.
    """
    h = min(int(v), HEAD_RANKS)
    head = np.exp(-s * np.log(np.arange(1, h + 1, dtype=np.float64)))
    head.setflags(write=False)  # cached: shared between callers
    a, b = HEAD_RANKS + 0.5, float(v) + 0.5
    return head, (_power_integral(s, a, b) if v > HEAD_RANKS else 0.0), a, b


def _power_integral(s: float, a: float, b: float) -> float:
    """integral_a^b x**-s dx, stable near s == 1 (expm1 form)."""
    t, lg = 1.0 - s, np.log(b / a)
    return float(lg if abs(t * lg) < 1e-12 else np.exp(t * np.log(a)) * np.expm1(t * lg) / t)


def _alias_table(p: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Walker/Vose alias table of probabilities p float64[K]: O(1) sampling, unlike searchsorted
    whose random access over the CDF was the generator's bottleneck."""
    k = len(p)
    q = p * (k / p.sum())
    prob, alias = np.ones(k), np.arange(k)
    small = [i for i in range(k) if q[i] < 1.0]
    large = [i for i in range(k) if q[i] >= 1.0]
    while small and large:
        lo, hi = small.pop(), large.pop()
        prob[lo], alias[lo] = q[lo], hi
        q[hi] -= 1.0 - q[lo]
        (small if q[hi] < 1.0 else large).append(hi)
    return prob, alias  # leftovers keep prob 1 (round-off)


@functools.lru_cache(maxsize=256)
def _feature_table(f) -> Tuple[np.ndarray, np.ndarray, int]:
    """Alias table over buckets [empty, top value, Zipf ranks 1..h, Zipf tail] of a CategoricalProfile."""
    head, tail, _, _ = zipf_parts(float(f.zipf_exponent), f.vocab_size - 1)
    zipf = np.append(head, tail) / (head.sum() + tail)
    p = np.concatenate([[f.empty_fraction, (1 - f.empty_fraction) * f.top_fraction],
                        (1 - f.empty_fraction) * (1 - f.top_fraction) * zipf])
    return (*_alias_table(p), len(head))


def _sample_tail(w: np.ndarray, s: float, v: int) -> np.ndarray:
    """int64[len(w)] ranks in HEAD_RANKS+1..v from uniforms w: inverse CDF of x**-s on [a, b), rounded."""
    _, _, a, b = zipf_parts(float(s), int(v))
    t, lg = 1.0 - s, np.log(b / a)
    if abs(t * lg) < 1e-12:
        x = a * np.exp(w * lg)
    else:  # x = a * (1 + w*expm1(t*L))**(1/t), t = 1 - s, L = ln(b/a); stable near s == 1
        x = a * np.exp(np.log1p(w * np.expm1(t * lg)) / t)
    return np.clip(np.floor(x + 0.5), HEAD_RANKS + 1, v).astype(np.int64)


def _rng(seed: int, stream: int, column: int) -> np.random.Generator:
    # One independent stream per (seed, batch stream, column): generating fewer columns
    # (batch_ids_only) or another batch never changes the values of a given column.
    return np.random.default_rng([seed, stream, column])


def _categorical(rng, n: int, feature_index: int, f) -> np.ndarray:
    prob, alias, h = _feature_table(f)
    u = rng.random(n) * len(prob)
    j = np.minimum(u.astype(np.int64), len(prob) - 1)  # u*K can round up to K
    bucket = np.where(u - j < prob[j], j, alias[j])  # one uniform: integer part picks, fraction flips
    rank = bucket - 1  # bucket 1 = top value = rank 0, bucket 1 + r = Zipf rank r
    in_tail = bucket == h + 2
    if in_tail.any():
        rank[in_tail] = _sample_tail(rng.random(int(in_tail.sum())), f.zipf_exponent, f.vocab_size - 1)
    ids = scramble_ids(np.int64(feature_index + 1) << np.int64(ID_RANK_BITS) | rank)
    ids[bucket == 0] = MISSING_ID
    return ids


def _dense(rng, n: int, f) -> np.ndarray:
    u = rng.random(n)
    z = rng.normal(f.log1p_mean, f.log1p_std, n)
    x = np.clip(np.floor(np.expm1(z) + 0.5), 1.0, f.max_value)  # positive integer counts
    p_neg = (1.0 - f.empty_fraction) * f.negative_fraction
    p_zero = (1.0 - f.empty_fraction) * f.zero_fraction
    v = u - f.empty_fraction  # position inside the present-value mass
    neg = (v >= 0) & (v < p_neg)
    x[neg] = rng.integers(int(f.negative_min), 0, size=int(neg.sum()))
    x[(v >= p_neg) & (v < p_neg + p_zero)] = 0.0
    x[v < 0] = DENSE_MISSING
    return x.astype(np.float32)


def _check(num_rows, seed) -> None:
    if isinstance(num_rows, bool) or not isinstance(num_rows, (int, np.integer)) or num_rows < 0:
        raise ValueError(f"num_rows must be a non-negative int, got {num_rows!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")


def _generate(num_rows: int, seed: int, stream: int, profile: DatasetProfile,
              batch_ids_only: bool) -> Dict[str, np.ndarray]:
    out = {}
    for i, f in enumerate(profile.categorical):
        out[f.name] = _categorical(_rng(seed, stream, i), num_rows, i, f)
    if not batch_ids_only:
        base = len(profile.categorical)
        for j, d in enumerate(profile.dense):
            out[d.name] = _dense(_rng(seed, stream, base + j), num_rows, d)
        out["label"] = (_rng(seed, stream, base + len(profile.dense)).random(num_rows)
                        < profile.label_positive_rate).astype(np.float32)
    return out


def generate_criteo_like(num_rows: int, seed: int = 0,
                         profile: Union[None, str, DatasetProfile] = None,
                         batch_ids_only: bool = False) -> Dict[str, np.ndarray]:
    """Generates `num_rows` rows that follow `profile` (default: the packaged "criteo" profile).

    Args:
      num_rows: rows to generate, >= 0.
      seed: non-negative int; equal seeds give equal data.
      profile: a DatasetProfile, a packaged profile name or a profile JSON path.
      batch_ids_only: only the categorical columns (faster); their values equal the full call's.
    Returns:
      {"C1".."C26": int64[num_rows] IDs (MISSING_ID where empty),
       "I1".."I13": float32[num_rows] raw integer-valued counts (DENSE_MISSING where empty; models
       usually take log1p(max(x, 0))), "label": float32[num_rows] in {0, 1}}.
    Raises:
      ValueError: negative num_rows or seed, unknown or invalid profile.
    """
    _check(num_rows, seed)
    return _generate(int(num_rows), int(seed), 0, load_profile(profile or "criteo"), batch_ids_only)


def criteo_like_batch_keys(batch_size: int, seed: int = 0,
                           profile: Union[None, str, DatasetProfile] = None
                           ) -> Tuple[np.ndarray, np.ndarray]:
    """One batch in the fused ops' input layout: all features' keys concatenated feature-major.

    Returns:
      keys: int64[M * batch_size], keys of feature 0 (C1) first, then feature 1, ... (empties as
        MISSING_ID, so every row contributes one key per feature).
      segment_splits: int64[M + 1] = [0, batch_size, 2 * batch_size, ...]; M = 26 for Criteo.
    """
    prof = load_profile(profile or "criteo")
    cols = generate_criteo_like(batch_size, seed, prof, batch_ids_only=True)
    keys = np.concatenate([cols[n] for n in prof.categorical_names]) if batch_size else np.zeros(0, np.int64)
    splits = np.arange(len(prof.categorical) + 1, dtype=np.int64) * int(batch_size)
    return keys.astype(np.int64), splits


def synthetic_dataset(batch_size: int, num_batches: Optional[int] = None, seed: int = 0,
                      profile: Union[None, str, DatasetProfile] = None, batch_ids_only: bool = False):
    """A tf.data.Dataset of dict batches (same keys, dtypes as `generate_criteo_like`, shape [batch_size]).

    Batch i is drawn from stream i + 1 of `seed`, so the dataset is deterministic and batch i does
    not depend on how many batches were read before. num_batches=None repeats forever.
    """
    import tensorflow as tf  # on use: tf_fusedemb.data imports without TensorFlow (data/__init__)

    _check(batch_size, seed)
    prof = load_profile(profile or "criteo")
    spec = {n: tf.TensorSpec([batch_size], tf.int64) for n in prof.categorical_names}
    if not batch_ids_only:
        spec.update({n: tf.TensorSpec([batch_size], tf.float32) for n in prof.dense_names})
        spec["label"] = tf.TensorSpec([batch_size], tf.float32)

    def gen():
        i = 0
        while num_batches is None or i < num_batches:
            yield _generate(batch_size, int(seed), i + 1, prof, batch_ids_only)
            i += 1

    return tf.data.Dataset.from_generator(gen, output_signature=spec)
