"""Fits a `DatasetProfile` to a Criteo TSV sample and writes it as JSON.

    python -m tf_fusedemb.data.fit_profile PATH/train.txt --out tf_fusedemb/data/criteo_profile.json

Categorical fit (per feature, on the non-empty values of the sample):
  * empty_fraction: share of empty cells; top_fraction: share of the most frequent value (Criteo
    columns often have one "default" value far above any power law, e.g. C10: 2207 then 91).
  * zipf_exponent s and vocabulary V of the remaining values, by minimum distance on the count
    spectrum: N_k = number of distinct values seen at least k times. Under Zipf(s) over V ranks and
    m draws, E[N_k] = sum_r P(Poisson(m p_r) >= k). For each s on a grid, V is solved so that
    E[N_1] equals the observed cardinality exactly (unique counts drive the AlltoAll sizes, so
    they are matched, not approximated); s is then the one minimising
    sum_k (log(N_k + 0.5) - log(E[N_k] + 0.5))**2 over k = 2 .. max count (log-spaced, plus the
    counts of the 16 most frequent values and those + 1).
    Unlike least squares on the sorted rank-frequency plot, N_k has no order-statistics bias, and
    the same model extrapolates V beyond the sample (capped at MAX_VOCAB).
Dense fit: empty / negative / zero fractions, mean and std of log1p(x) over positive x, min, max.
Fitting needs only numpy; reading the TSV uses `criteo.read_criteo` (TensorFlow).
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Dict, Sequence, Tuple

import numpy as np

from .criteo import CRITEO_CATEGORICAL, CRITEO_DENSE, read_criteo
from .profile import DatasetProfile
from .synthetic import zipf_parts

__all__ = ["expected_spectrum", "fit_zipf", "fit_counts", "fit_dense", "fit_criteo"]

MAX_VOCAB = 10**9           # extrapolation cap (Criteo Kaggle's largest column has ~10M values)
# Fine where Criteo's exponents lie, coarse up to 10 for columns with a handful of steep values.
_S_GRID = np.concatenate([np.arange(0.0, 4.0, 0.02), np.arange(4.0, 10.0001, 0.1)])
_TAIL_NODES = 160           # quadrature nodes over log x for ranks beyond HEAD_RANKS
_EXACT_K = 64               # Poisson tail exact up to this k, normal approximation above
METHOD = ("categorical: empty and top-value fractions counted; Zipf(s, V) of the other values by "
          "minimum distance on the count spectrum N_k (distinct values seen >= k times), V solved so "
          "E[N_1] = observed cardinality; dense: fractions, log1p mean/std of positive values")


def _norm_sf(x: np.ndarray) -> np.ndarray:
    """1 - Phi(x) via the Numerical Recipes erfc (relative error < 1.2e-7); numpy has no erf."""
    z = np.abs(x) / math.sqrt(2.0)
    t = 1.0 / (1.0 + 0.5 * z)
    poly = -1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (-0.18628806 + t * (
        0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277))))))))
    erfc = t * np.exp(-z * z + poly)
    return np.where(x >= 0, 0.5 * erfc, 1.0 - 0.5 * erfc)


def _poisson_sf(lam: np.ndarray, ks: Sequence[int]) -> np.ndarray:
    """float64[len(ks), len(lam)]: P(Poisson(lam) >= k) for each k (ks ascending, >= 1)."""
    out = np.empty((len(ks), len(lam)))
    pmf, cdf, j = np.exp(-lam), np.zeros_like(lam), 0
    for i, k in enumerate(ks):
        if k <= _EXACT_K:
            while j < k:  # cdf = P(X <= j - 1) after the loop
                cdf += pmf
                j += 1
                pmf = pmf * lam / j
            out[i] = np.clip(1.0 - cdf, 0.0, 1.0)
        else:  # continuity-corrected normal approximation; counts this high are few and noisy anyway
            out[i] = _norm_sf((k - 0.5 - lam) / np.sqrt(np.maximum(lam, 1e-300)))
    return out


def _support(m: int, s: float, v: int) -> Tuple[np.ndarray, np.ndarray]:
    """(lam float64[h], weight float64[h]): Poisson rates m*p_r of the ranks, with quadrature weights."""
    head, tail, a, b = zipf_parts(float(s), int(v))
    z = head.sum() + tail
    if tail <= 0:
        return m * head / z, np.ones_like(head)
    y = np.linspace(math.log(a), math.log(b), _TAIL_NODES)
    x = np.exp(y)
    w = np.full(_TAIL_NODES, y[1] - y[0]) * x  # trapezoid in log x: dx = x dy
    w[[0, -1]] *= 0.5
    return np.concatenate([m * head / z, m * np.exp(-s * y) / z]), np.concatenate([np.ones_like(head), w])


def expected_spectrum(m: int, s: float, v: int, ks: Sequence[int]) -> np.ndarray:
    """float64[len(ks)]: E[number of distinct values seen >= k times] in m draws of Zipf(s) over v ranks."""
    lam, w = _support(m, s, v)
    return _poisson_sf(lam, ks) @ w


def _expected_distinct(m: int, s: float, v: int) -> float:
    lam, w = _support(m, s, v)
    return float(-np.expm1(-lam) @ w)


def _solve_vocab(m: int, d: int, s: float):
    """Smallest V with E[distinct] ~= d for exponent s, or None if even MAX_VOCAB is too few."""
    if _expected_distinct(m, s, d) >= d - 0.5:
        return d
    if _expected_distinct(m, s, MAX_VOCAB) < d:
        return None
    lo, hi = math.log(d), math.log(MAX_VOCAB)  # E[distinct] increases with V (majorisation)
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if _expected_distinct(m, s, int(round(math.exp(mid)))) < d else (lo, mid)
    return int(round(math.exp(hi)))


def fit_zipf(counts: np.ndarray) -> Tuple[float, int]:
    """Fits (s, V) of Zipf to counts int64[D] of D distinct values (see module docstring)."""
    counts = np.asarray(counts, dtype=np.int64)
    m, d = int(counts.sum()), int(len(counts))
    if d <= 1:
        return 0.0, 1
    # Log-spaced thresholds, plus the steps of the top values (c and c + 1) so that few-valued,
    # high-count columns (C20: 1430, 1394) are resolved rather than falling between thresholds.
    top = np.sort(counts)[::-1][:16]
    ks = np.concatenate([np.round(np.geomspace(2, max(2, counts.max()), 24)), top, top + 1])
    ks = np.unique(ks[ks >= 2].astype(np.int64))
    obs = np.log((counts[None, :] >= ks[:, None]).sum(1) + 0.5)

    def loss(s):
        v = _solve_vocab(m, d, s)
        if v is None:
            return math.inf, v
        return float(((obs - np.log(expected_spectrum(m, s, v, ks) + 0.5)) ** 2).sum()), v

    grid = [loss(s) for s in _S_GRID]
    s0 = float(_S_GRID[int(np.argmin([g[0] for g in grid]))])
    step = 0.02 if s0 < 4.0 else 0.1
    fine = [(s, *loss(s)) for s in np.arange(max(0.0, s0 - step), min(10.0, s0 + step) + 1e-9, step / 10)]
    s, _, v = min(fine, key=lambda t: t[1])
    return round(float(s), 3), int(v)


def fit_counts(name: str, counts: np.ndarray, num_rows: int) -> Dict:
    """Profile fields of one categorical feature from counts int64[D] of its non-empty values."""
    counts = np.sort(np.asarray(counts, dtype=np.int64))[::-1]
    m = int(counts.sum())
    s, v = fit_zipf(counts[1:])  # the top value is modelled separately (top_fraction)
    return dict(name=name, observed_cardinality=int(len(counts)),
                empty_fraction=round(1.0 - m / num_rows, 6) if num_rows else 1.0,
                top_fraction=round(counts[0] / m, 6) if m else 0.0,
                zipf_exponent=s, vocab_size=v + 1, num_nonempty=m)


def fit_dense(name: str, values: np.ndarray, missing: np.ndarray) -> Dict:
    """Profile fields of one integer dense feature.

    Args:
      values: float[n], the raw values (as `criteo.read_criteo` gives them).
      missing: bool[n], True where the cell was empty (its value is ignored).
    """
    x = np.asarray(values, np.float64)[~np.asarray(missing, bool)]
    pos = np.log1p(x[x > 0])
    r = lambda v: round(float(v), 6)  # noqa: E731
    return dict(name=name, empty_fraction=r(1.0 - len(x) / max(1, len(missing))),
                negative_fraction=r((x < 0).mean()) if len(x) else 0.0,
                zero_fraction=r((x == 0).mean()) if len(x) else 0.0,
                log1p_mean=r(pos.mean()) if len(pos) else 0.0, log1p_std=r(pos.std()) if len(pos) else 0.0,
                negative_min=float(min(-1.0, x.min())) if len(x) else -1.0,
                max_value=float(max(1.0, x.max())) if len(x) else 1.0)


def fit_criteo(path, name: str = "criteo", max_rows: int = 0) -> DatasetProfile:
    """Fits a profile to a Criteo TSV, read by `criteo.read_criteo` (the one Criteo parser)."""
    cols = read_criteo(path, max_rows or None, with_missing=True)
    missing, n = cols["missing"], len(cols["label"])
    cat_profiles = [fit_counts(c, np.unique(cols[c][~missing[c]], return_counts=True)[1], n)
                    for c in CRITEO_CATEGORICAL]
    return DatasetProfile.from_dict(dict(
        name=name, num_rows=n, source=Path(path).name, method=METHOD,
        label_positive_rate=round(float((cols["label"] == 1).mean()), 6),
        categorical=cat_profiles, dense=[fit_dense(d, cols[d], missing[d]) for d in CRITEO_DENSE]))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Fit a DatasetProfile to a Criteo TSV sample.")
    ap.add_argument("path", help="Criteo TSV (label, I1..I13, C1..C26)")
    ap.add_argument("--out", default="-", help="output JSON path ('-' = stdout)")
    ap.add_argument("--name", default="criteo")
    ap.add_argument("--max-rows", type=int, default=0)
    a = ap.parse_args(argv)
    text = json.dumps(fit_criteo(a.path, a.name, a.max_rows).to_dict(), indent=1) + "\n"
    if a.out == "-":
        print(text, end="")
    else:
        Path(a.out).write_text(text)
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
