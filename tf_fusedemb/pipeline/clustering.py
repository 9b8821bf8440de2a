"""Key-centric sample clustering (NestPipe, section V-C): reorder a batch so samples that share
sparse keys land in the same micro-batch.

Frozen-window pipelining splits each rank's batch of B samples into N contiguous micro-batches
(micro-batch i = rows [i*B//N, (i+1)*B//N)) and deduplicates keys only within a micro-batch, so
the embedding All2All of a step carries sum_i |unique (feature, id) keys of micro-batch i| rows.
A key used by samples of several micro-batches is sent once per micro-batch. Clustering permutes
the samples INSIDE the batch (the batch's composition, hence the model's values and gradients,
is unchanged) so that such samples meet in one micro-batch.

NestPipe states the goal ("group samples that share more sparse keys into the same micro-batch,
maximizing key redundancy within micro-batch"), that it must be lightweight, and that it runs
asynchronously on the CPU in the data stage (here: `cluster_dataset` of
tf_fusedemb.pipeline.clustered_dataset, a parallel tf.data map);
it gives no algorithm. Finding the best order is balanced hypergraph partitioning (samples =
vertices, keys shared by >= 2 samples = hyperedges, objective = sum over keys of the number of
micro-batches holding it, i.e. exactly the rows the embedding All2Alls carry; the
"connectivity - 1" metric of hypergraph partitioners), with every part of exactly its
micro-batch size. `cluster_permutation` implements a cheap two-phase version of what such
partitioners do: a recursive bisection by a momentum-accelerated diffusion vector of the
sample-key graph (global structure), then Kernighan-Lin / Fiduccia-Mattheyses style swap
refinement between the micro-batches with exact gains of that objective (local moves). See the
comment above _POWER_ITERATIONS for the measurements behind the choice and the achievable
reductions (on the real Criteo sample at N = 4: 22% fewer keys, 17.5% with the previous,
bisection-only version).

This module is numpy only; the tf.data transform is tf_fusedemb.pipeline.clustered_dataset.
"""
from __future__ import annotations

from typing import List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np

__all__ = ["RaggedIds", "micro_batch_bounds", "unique_keys_per_micro_batch",
           "cluster_permutation"]

# One feature of one batch: int[B] (one id per sample), int[B, k] (k ids per sample), or a
# sequence of B per-sample id sequences (multi-hot, lengths may differ, may be empty), or,
# from cluster_dataset, ragged ids in CSR form (RaggedIds).
FeatureValues = Union[np.ndarray, Sequence[Sequence[int]], "RaggedIds"]


class RaggedIds(NamedTuple):
    """Multi-hot ids of B samples in CSR form (what a tf.RaggedTensor [B, None] holds): the ids
    of sample i are values[row_splits[i]:row_splits[i + 1]]. What cluster_dataset hands
    over for a ragged feature."""
    values: np.ndarray  # int[P]
    row_splits: np.ndarray  # int[B + 1], row_splits[0] = 0, nondecreasing


_U64 = np.uint64
# 2**64 / golden ratio (odd): Fibonacci hashing. Multiplying by an odd constant is a bijection
# of the 64-bit words and the product's top bits mix all input bits, so keeping only the bits
# left over after the row and feature fields merges two distinct ids with probability about
# 2**-hash_bits (hash_bits = 64 - log2(B) - log2(F) >= 34 for B <= 2**20, F <= 2**10).
_GOLDEN = _U64(0x9E3779B97F4A7C15)
_MIN_HASH_BITS = 16


def micro_batch_bounds(batch_size: int, num_micro_batches: int) -> List[Tuple[int, int]]:
    """Row ranges of the micro-batches of a batch: [(i*B//N, (i+1)*B//N) for i in range(N)].

    Args:
      batch_size: B >= 0.
      num_micro_batches: N >= 1 (N > B gives some empty micro-batches).
    Returns:
      list of N (lo, hi) pairs; they tile [0, B) in order and their sizes differ by at most 1.
    Raises:
      ValueError: B < 0 or N < 1.
    """
    b, n = _check_sizes(batch_size, num_micro_batches)
    return [(i * b // n, (i + 1) * b // n) for i in range(n)]


def unique_keys_per_micro_batch(features: Mapping[str, FeatureValues],
                                num_micro_batches: int) -> np.ndarray:
    """Distinct (feature, id) keys of each micro-batch: what FWP's per-micro-batch dedup sends.

    Args:
      features: {name: values} for one batch of B samples; values int[B], int[B, k] or a
        sequence of B per-sample id lists (multi-hot). Every feature must have B samples.
      num_micro_batches: N >= 1; micro-batch i is rows [i*B//N, (i+1)*B//N).
    Returns:
      int64[N]: entry i = number of distinct (feature, id) pairs among the samples of
      micro-batch i (exact, no hashing). Their sum is the batch's communicated key count.
    Raises:
      ValueError: features of different batch sizes, N < 1, non-integer ids.
    """
    feats, b = _as_flat_features(features)
    bounds = micro_batch_bounds(b, num_micro_batches)
    his = np.array([hi for _, hi in bounds], np.int64)
    out = np.zeros(len(bounds), np.int64)
    for values, rows in feats:
        rows = np.arange(b) if rows is None else rows
        mb = np.searchsorted(his, rows, side="right")  # micro-batch of each id
        # Sort the (micro-batch, id) pairs; each change of pair starts a distinct key.
        order = np.lexsort((values, mb))
        v, m = values[order], mb[order]
        first = np.ones(len(v), bool)
        first[1:] = (v[1:] != v[:-1]) | (m[1:] != m[:-1])
        out += np.bincount(m[first], minlength=len(bounds))
    return out


# Algorithm choice. Figures: reduction of the summed per-micro-batch unique keys vs the unclustered
# order on the 26 Criteo columns C1..C26 at N=4, measured as benchmarks.pipeline does (2026-11):
# "real" = clustering_unique_key_reduction_real, the Kaggle sample read with
# tf_fusedemb.data.criteo in batches of 4096 lines (2 batches, 4096 + 3904 rows); "synthetic" =
# clustering_unique_key_reduction, the benchmark's rank-0 batches (8 x 4096 generate_criteo_like
# rows, 2 ranks, seed 0).
#   recursive bisection, 8 plain iterations per level
#   (the previous version of this code):                             8.4% synthetic, 17.5% real
#   ... + a prototype of this code's swap refinement, 20 rounds:    10.9% synthetic, 19.4% real
#   ... 24 / 32 / 128 plain iterations, no refinement:       9.4 / 9.4 / 8.7%, 19.4 / 20.2 / 21.1%
#   ... exact Fiedler vectors (Lanczos, 10-40 steps) instead:      8.5-9.1% synthetic, 17-19% real
#   ... 24 iterations, momentum after 8 (no refinement):            9.3% synthetic, 21.1% real
#   ... + 1 / 2 / 4 (this code) / 8 rounds of swap refinement: 10.2 / 10.7 / 11.1 / 11.3% synthetic,
#                                                              21.6 / 21.9 / 22.05 / 22.2% real
# Earlier figures (2026-11, first 4096 real lines, generate_criteo_like(4096, seed=7)): a
# lexicographic sort by features ranked by expected savings 3.5% synthetic / 10.3% real; one
# spectral ordering cut into N blocks 5.2 / 14.6%; KaHyPar km1, a state of the art hypergraph
# partitioner taking seconds per batch, 10.6 / 22.9%.
# At N=2 / 8 this code gives 7.3 / 12.6% synthetic and 12.1 / 28.3% real (previous version
# 5.9 / 9.3% and 10.0 / 22.6%). Cost, numpy, CPU time per 4096 x 26 batch on one core of a
# busy shared 2-core VM (median, interleaved with the previous version): N=4 ~19-21 ms (previous
# ~6 ms; the 106k-element sort of the keys ~3 ms, 2 levels x 24 iterations of two bincounts over
# ~35k incidences ~9 ms, refinement ~5 ms); N=2 ~13 ms (5), N=8 ~28-31 ms (8).
#
# Why these pieces:
# * The walk is a diffusion: after t steps a random start vector becomes roughly a random
#   combination of the walk's slowest modes, i.e. of indicators of groups of samples that share
#   many keys, so sorting by it puts such groups next to each other and the cut keeps them
#   whole. The more steps, the sharper the groups: 8 steps left the vector noisy. The exact
#   second eigenvector (what spectral partitioners use) is worse: it singles out one tightly
#   knit group and leaves the order of the rest arbitrary. Momentum (x_{t+1} = M x_t -
#   beta x_{t-1}, beta = lambda^2 / 4, lambda = the segment's Rayleigh quotient after 8 plain
#   steps; Xu et al., "Accelerated stochastic power iteration", 2018) damps every mode below lambda
#   at the same rate sqrt(beta), so 24 steps filter about as sharply as ~128 plain ones. beta
#   must stay <= lambda_max^2 / 4 or the modes oscillate (a fixed beta = 0.2, which helps the
#   real rows, drops the synthetic ones to 1.8%: their lambda is ~0.6-0.8); the Rayleigh
#   quotient is <= lambda_max, hence the per-segment estimate.
# * The bisection never sees the objective itself; the refinement does: it swaps samples
#   between micro-batches with gains computed exactly from per-micro-batch key counts, and
#   keeps a round only if the recounted objective drops (see _refine_swaps). It uses every
#   shared key, not only the small ones of the bisection.
_POWER_ITERATIONS = 24
# Plain iterations before the momentum coefficient is estimated; a multiple of
# _RENORMALIZE_EVERY, so the estimate sees a freshly recentred vector.
_MOMENTUM_WARMUP = 8
_RENORMALIZE_EVERY = 8  # iterations between recentring/rescaling the vector (precision only)
_REFINE_ROUNDS = 4
_REFINE_HALVINGS = 3  # a round that does not lower the objective retries with 1/2, 1/4, 1/8
_HOT_MARGIN = 3  # keys with more than this many samples in EVERY micro-batch are left out

def _max_key_count(b: int, n: int) -> int:
    """Keys shared by more samples than this are left out of the bisection (not the refinement).

    A key of more than B/N samples spans several micro-batches whatever the order. Keys of
    B/(8N)..B/N samples could still be grouped, but each saves at most N - 1 copies and their
    weight is tiny (see _savings_weight) while their incidences are ~60% of the shared-key
    incidences on Criteo (55k of 90k at B=4096, N=4, where doubling this limit changes the
    reduction by under 0.1 point); the refinement uses every shared key. Keys of up to
    min(B/N, 16) samples are always kept, so small batches, where such keys may be the only
    structure, are still clustered.
    """
    return max(2, b // (8 * n), min(b // n, 16))


def _savings_weight(count: np.ndarray, n: int) -> np.ndarray:
    """float64[K]: expected extra micro-batch copies per sample of keys shared by `count`
    samples when the batch is in random order: (N * (1 - (1 - 1/N)**c) - 1) / c.

    A key of c samples saves at most N - 1 copies however large c is, but its pull on the
    diffusion vector grows with c; weighting its incidences by this keeps a few big keys from
    outvoting the many small ones (+1.2 points synthetic, +1.0 real over unit weights, measured
    with the 8-iteration version).
    """
    c = count.astype(np.float64)
    return (n * -np.expm1(c * np.log1p(-1.0 / n)) - 1.0) / c


def cluster_permutation(features: Mapping[str, FeatureValues], num_micro_batches: int,
                        seed: int = 0) -> np.ndarray:
    """Key-centric sample order of one batch: recursive diffusion bisection of the key graph,
    then exact-gain swap refinement between the micro-batches.

    1. Bisection. Samples are vertices and every (feature, id) key shared by 2..max(B/(8N),
       min(B/N, 16)) samples joins them (bigger keys span several micro-batches whatever the
       order, or save too little for their cost, see _max_key_count). At each level the rows
       of a segment (a range of micro-batches) get a smoothed random vector: 24 iterations of
       "key value = mean of its samples' values, sample value = weighted mean of its keys'
       values" (a random walk on the sample-key graph restricted to the segment; key weights
       = expected dedup savings per sample, see _savings_weight), accelerated by momentum
       after the first 8, which make samples that share keys, directly or through chains,
       take close values. The segment's rows are sorted by that value and cut at the
       micro-batch boundary nearest its middle, so both halves hold whole micro-batches; the
       halves are split the same way until each segment is one micro-batch.
    2. Refinement (_refine_swaps): a few rounds of swaps of samples between micro-batches,
       with gains computed exactly from the per-micro-batch counts of every shared key, each
       round kept only if the recounted sum of per-micro-batch unique keys drops.

    Swaps keep every micro-batch at its size, so micro-batch i of the result is rows
    [i*B//N, (i+1)*B//N) of batch[perm] as before (sizes differ by at most 1), and the result
    is a permutation. Deterministic (fixed-seed start vector, stable sorts). Ids are hashed to
    64 - log2(B) - log2(F) bits for speed; a collision merges two keys in the heuristic only.

    Args:
      features: {name: values} for one batch of B samples: int[B], int[B, k] (every id used) or
        a sequence of B per-sample id lists (multi-hot, every id used; empty lists allowed).
      num_micro_batches: N >= 1.
      seed: seed of the start vector (the default is fine; other seeds give other good orders).
    Returns:
      int64[B] permutation: clustered batch = batch[perm] (row j of the new batch is old row
      perm[j]); within a micro-batch the rows keep their batch order. Identity when N == 1,
      B <= 1, no key is shared, or the batch order already has no more unique keys per
      micro-batch (in sum) than the clustered one: clustering never makes a batch worse.
    Raises:
      ValueError: features of different batch sizes, N < 1, non-integer ids, too many rows or
        features for the hash layout.
    """
    feats, b = _as_flat_features(features)
    _, n = _check_sizes(b, num_micro_batches)
    if n == 1 or b <= 1:
        return np.arange(b, dtype=np.int64)
    rows, kid, key_count = _shared_key_pins(feats, b, b)
    if rows.size == 0:
        return np.arange(b, dtype=np.int64)
    small = key_count[kid] <= _max_key_count(b, n)
    if small.any():
        order = _diffusion_bisection(rows[small], kid[small], _savings_weight(key_count, n),
                                     len(key_count), b, n, seed)
    else:  # only keys of more than _max_key_count samples: refine the batch order
        order = np.arange(b)
    sizes = np.diff([i * b // n for i in range(n + 1)])
    part = np.empty(b, np.intp)
    part[order] = np.repeat(np.arange(n), sizes)
    part = _refine_swaps(rows, kid, len(key_count), part, n)
    # Never worse than the batch's own order (it can be on tiny batches with little structure).
    kn = kid * n
    unclustered = np.repeat(np.arange(n), sizes)[rows]
    if (np.count_nonzero(np.bincount(kn + part[rows], minlength=len(key_count) * n))
            >= np.count_nonzero(np.bincount(kn + unclustered, minlength=len(key_count) * n))):
        return np.arange(b, dtype=np.int64)
    return np.argsort(part, kind="stable").astype(np.int64)


def _diffusion_bisection(rows: np.ndarray, kid: np.ndarray, key_weight: np.ndarray,
                         num_keys: int, b: int, n: int, seed: int) -> np.ndarray:
    """Pins (sample rows[p] uses key kid[p]), key_weight float[num_keys] -> int64[B] order
    whose N contiguous blocks [i*B//N, (i+1)*B//N) are the micro-batches; see
    cluster_permutation and the comment above _POWER_ITERATIONS."""
    bounds = [i * b // n for i in range(n + 1)]
    deg = np.bincount(rows, weights=key_weight[kid], minlength=b)
    inv_deg = np.divide(1.0, deg, out=np.zeros_like(deg), where=deg > 0)
    x0 = np.random.default_rng(seed).standard_normal(b)
    segs = [(0, n)]  # segment s holds micro-batches [p0, p1)
    lab = np.zeros(b, np.intp)  # segment of each row
    order = np.arange(b)
    while any(p1 - p0 > 1 for p0, p1 in segs):
        ns = len(segs)
        # A key seen in several segments becomes one key per segment: the halves are
        # partitioned independently, as their rows can no longer meet.
        kk = kid * ns + lab[rows] if ns > 1 else kid
        kc = np.bincount(kk, minlength=num_keys * ns).astype(np.float64)
        w = np.repeat(key_weight, ns) if ns > 1 else key_weight  # weight of key kk // ns
        w_kc = np.divide(w, kc, out=np.zeros_like(kc), where=kc > 0)
        seg_deg = np.bincount(lab, weights=deg, minlength=ns)
        inv_seg_deg = np.divide(1.0, seg_deg, out=np.zeros_like(seg_deg), where=seg_deg > 0)
        # The walk M: x -> (sum over the sample's keys of w_k * mean of x over the key's
        # samples) / deg. M is self-adjoint for <x, z>_deg, its top eigenvector is constant per
        # segment (eigenvalue 1) and its spectrum lies in [0, 1].
        x, x_prev, beta = x0.copy(), np.zeros(b), None
        for it in range(_POWER_ITERATIONS):
            if it % _RENORMALIZE_EVERY == 0:
                # Remove the constant (the deg-weighted segment mean, which M preserves) and
                # rescale each segment; the order of the values is unchanged.
                for v in (x, x_prev):
                    v -= (np.bincount(lab, weights=v * deg, minlength=ns) * inv_seg_deg)[lab]
                norm = np.sqrt(np.bincount(lab, weights=x * x, minlength=ns))
                scale = np.divide(1.0, norm, out=np.zeros_like(norm), where=norm > 0)[lab]
                x, x_prev = x * scale, x_prev * scale
            key_sum = np.bincount(kk, weights=x[rows], minlength=num_keys * ns)
            if it == _MOMENTUM_WARMUP:
                # Rayleigh quotient <x, Mx>_deg / <x, x>_deg per segment (<= its largest
                # non-trivial eigenvalue): beta = lambda^2 / 4 keeps the modes above lambda
                # growing and damps all below at rate sqrt(beta) without oscillation.
                key_seg = np.arange(num_keys * ns) % ns
                num = np.bincount(key_seg, weights=key_sum * key_sum * w_kc, minlength=ns)
                den = np.bincount(lab, weights=deg * x * x, minlength=ns)
                lam = np.divide(num, den, out=np.zeros_like(num), where=den > 0)
                beta = (np.minimum(lam, 1.0) ** 2 / 4)[lab]
            x_next = np.bincount(rows, weights=(key_sum * w_kc)[kk], minlength=b) * inv_deg
            if beta is not None and it > _MOMENTUM_WARMUP:
                x_next -= beta * x_prev
            x_prev, x = x, x_next
        # By segment, then by vector value (two stable argsorts: ties keep row order; cheaper
        # than np.lexsort).
        order = np.argsort(x, kind="stable")
        order = order[np.argsort(lab[order], kind="stable")]
        new_segs: List[Tuple[int, int]] = []
        new_lab = np.empty(b, np.intp)
        for p0, p1 in segs:
            cuts = [p0, (p0 + p1) // 2, p1] if p1 - p0 > 1 else [p0, p1]
            for q0, q1 in zip(cuts[:-1], cuts[1:]):
                new_lab[order[bounds[q0]:bounds[q1]]] = len(new_segs)
                new_segs.append((q0, q1))
        segs, lab = new_segs, new_lab
    return order.astype(np.int64)


def _refine_swaps(rows: np.ndarray, kid: np.ndarray, num_keys: int, part: np.ndarray,
                  n: int) -> np.ndarray:
    """Pins of every shared key (sample rows[p] uses key kid[p]), intp[B] micro-batch of each
    sample -> improved intp[B] with the same micro-batch sizes.

    Objective: sum over keys of the number of micro-batches holding the key (the summed
    per-micro-batch unique keys, up to the constant of the keys of one sample). With C[k, q] =
    samples of micro-batch q using key k, moving sample v from micro-batch a to q changes it by
    exactly -(#keys of v with C[k, a] == 1) + (#keys of v with C[k, q] == 0): its gain. Each
    round, like one pass of Kernighan-Lin / Fiduccia-Mattheyses done in bulk: every sample
    picks its best target; for each pair of micro-batches (a, q) the candidates a -> q and
    q -> a are sorted by gain and paired best with best while the pair's summed gain is
    positive; all those swaps are applied at once. Gains of swaps that touch the same key do
    not add up exactly, so the objective is recounted and a round that does not lower it is
    retried with the best 1/2, 1/4, 1/8 of each pair's swaps, then refinement stops.

    Keys with more than _HOT_MARGIN samples in every micro-batch are dropped first: they are
    in every micro-batch, so no swap set can make them cost more, and a single move cannot
    change them (gain 0). The recounted objective over the kept keys is therefore an upper
    bound on the change of the full one: an accepted round never makes the batch worse.
    """
    b = len(part)
    kn = kid * n
    count = np.bincount(kn + part[rows], minlength=num_keys * n)
    keep = (count.reshape(num_keys, n).min(axis=1) <= _HOT_MARGIN)[kid]
    if not keep.any():
        return part
    rows, kn = rows[keep], kn[keep]
    count = np.bincount(kn + part[rows], minlength=num_keys * n)
    objective = np.count_nonzero(count)
    parts = np.arange(n)
    pin_targets = ((rows * n)[:, None] + parts).ravel()  # (sample, target) of (pin, target)
    key_targets = (kn[:, None] + parts).ravel()  # (key, target) of (pin, target)
    samples = np.arange(b)
    for _ in range(_REFINE_ROUNDS):
        leave = np.bincount(rows, weights=count[kn + part[rows]] == 1, minlength=b)
        enter = np.bincount(pin_targets, weights=count[key_targets] == 0, minlength=b * n)
        gain = leave[:, None] - enter.reshape(b, n)
        gain[samples, part] = -np.inf
        target = gain.argmax(axis=1)
        swaps = _paired_swaps(part, target, gain[samples, target], n)
        if not swaps:
            break
        better = _first_better(part, swaps, rows, kn, num_keys * n, objective)
        if better is None:
            break
        part, count, objective = better
    return part


Swap = Tuple[np.ndarray, np.ndarray, int, int]  # (samples a -> q, samples q -> a, a, q)


def _paired_swaps(part: np.ndarray, target: np.ndarray, best: np.ndarray,
                  n: int) -> List[Swap]:
    """intp[B] micro-batch, intp[B] best target and float[B] its gain of every sample ->
    for each pair of micro-batches (a, q), its candidates a -> q and q -> a paired best with
    best while the pair's summed gain is positive (pairs without such a swap left out)."""
    # Candidates grouped by (from, to), best gain first (lexsort is stable: ties by row).
    group = part * n + target
    by_group = np.lexsort((-best, group))
    starts = np.searchsorted(group[by_group], np.arange(n * n + 1))
    swaps = []
    for a in range(n):
        for q in range(a + 1, n):
            out_a = by_group[starts[a * n + q]:starts[a * n + q + 1]]
            out_q = by_group[starts[q * n + a]:starts[q * n + a + 1]]
            m = min(len(out_a), len(out_q))
            # Both lists are sorted, so the pair sums decrease: a prefix is positive.
            m = int(np.count_nonzero(best[out_a[:m]] + best[out_q[:m]] > 0))
            if m:
                swaps.append((out_a[:m], out_q[:m], a, q))
    return swaps


def _first_better(part: np.ndarray, swaps: List[Swap], rows: np.ndarray, kn: np.ndarray,
                  size: int, objective: int
                  ) -> Optional[Tuple[np.ndarray, np.ndarray, int]]:
    """All of ``swaps`` applied to ``part``, else the best 1/2, 1/4, ... of each pair's
    (_REFINE_HALVINGS times): the first whose recounted objective is below ``objective``,
    as (part, count, objective); None if none is."""
    for halving in range(_REFINE_HALVINGS + 1):
        new_part = part.copy()
        for out_a, out_q, a, q in swaps:
            m = max(1, len(out_a) >> halving)
            new_part[out_a[:m]] = q
            new_part[out_q[:m]] = a
        new_count = np.bincount(kn + new_part[rows], minlength=size)
        new_objective = np.count_nonzero(new_count)
        if new_objective < objective:
            return new_part, new_count, new_objective
    return None


def _shared_key_pins(feats: List[Tuple[np.ndarray, Optional[np.ndarray]]], b: int,
                     max_count: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sample, key) incidences of the keys shared by 2..max_count samples.

    One sort of packed 64-bit words [feature | hash(id) | row] groups every key's samples
    (cheaper than a per-feature np.unique, or an argsort).
    Returns:
      rows intp[P], kid intp[P] (key index, 0..K-1, nondecreasing), key_count int64[K].
    """
    f = len(feats)
    rbits = max(1, (b - 1).bit_length())
    fbits = max(1, (f - 1).bit_length())
    if 64 - rbits - fbits < _MIN_HASH_BITS:
        raise ValueError(f"batch of {b} rows with {f} features leaves fewer than "
                         f"{_MIN_HASH_BITS} hash bits per id")
    sizes = [len(values) for values, _ in feats]
    s = np.empty(sum(sizes), np.uint64)
    one_per_row = np.arange(b, dtype=np.uint64)
    pos = 0
    with np.errstate(over="ignore"):  # wrap-around multiplication is the hash
        for i, (values, rows) in enumerate(feats):
            w = s[pos:pos + len(values)]
            np.multiply(values.view(np.uint64), _GOLDEN, out=w)
            w >>= _U64(rbits + fbits)
            w <<= _U64(rbits)
            w |= _U64(i) << _U64(64 - fbits)
            w |= one_per_row if rows is None else rows.view(np.uint64)
            pos += len(values)
    s.sort()
    if len(s) > 1 and any(rows is not None for _, rows in feats):
        # The same id twice in one multi-hot sample is one key of that sample.
        s = s[np.concatenate(([True], s[1:] != s[:-1]))]
    key = s >> _U64(rbits)
    new = np.empty(len(s), bool)
    new[:1] = True
    np.not_equal(key[1:], key[:-1], out=new[1:])
    count = np.diff(np.append(np.flatnonzero(new), len(s)))
    kept = (count >= 2) & (count <= max_count)
    key_count = count[kept]
    kid = np.repeat(np.arange(len(key_count), dtype=np.intp), key_count)
    rows = (s[np.repeat(kept, count)] & _U64((1 << rbits) - 1)).astype(np.intp)
    return rows, kid, key_count


def _check_sizes(batch_size, num_micro_batches) -> Tuple[int, int]:
    b, n = int(batch_size), int(num_micro_batches)
    if b < 0:
        raise ValueError(f"batch_size must be >= 0, got {batch_size}")
    if n < 1:
        raise ValueError(f"num_micro_batches must be >= 1, got {num_micro_batches}")
    return b, n


def _as_flat_features(features: Mapping[str, FeatureValues]
                      ) -> Tuple[List[Tuple[np.ndarray, Optional[np.ndarray]]], int]:
    """{name: values} -> ([(ids int64[P_f], row of each id int64[P_f]) per feature], B).

    The rows array is None for int[B] features (id i belongs to row i), which saves building
    and hashing B row indices per feature in the common one-hot case.

    B is returned separately because a multi-hot feature may hold no id at all.
    """
    if not features:
        raise ValueError("features is empty: need at least one feature to cluster on")
    out: List[Tuple[np.ndarray, Optional[np.ndarray]]] = []
    sizes = {}
    rows: Optional[np.ndarray]  # None: id i is of row i (see the docstring)
    for name, v in features.items():
        if isinstance(v, RaggedIds):
            splits = np.asarray(v.row_splits, np.int64)
            values = np.asarray(v.values)
            _check_int(name, values)
            b = len(splits) - 1
            values = np.ascontiguousarray(values, dtype=np.int64)
            rows = np.repeat(np.arange(b, dtype=np.int64), np.diff(splits))
        elif hasattr(v, "shape") and hasattr(v, "dtype"):  # numpy array (or array-like tensor)
            a = np.asarray(v)
            if a.ndim not in (1, 2):
                raise ValueError(f"feature {name!r}: expected ids of shape [B] or [B, k], got "
                                 f"shape {a.shape}")
            _check_int(name, a)
            b = a.shape[0]
            values = np.ascontiguousarray(a.reshape(-1), dtype=np.int64)
            rows = None if a.ndim == 1 else np.repeat(np.arange(b, dtype=np.int64), a.shape[1])
        else:  # a sequence of per-sample id lists (multi-hot); a bare id counts as a 1-list
            lists = [np.asarray(x).reshape(-1) for x in v]
            for x in lists:
                _check_int(name, x)
            b = len(lists)
            lens = np.array([len(x) for x in lists], np.int64)
            values = (np.concatenate(lists).astype(np.int64) if lens.sum() else
                      np.zeros(0, np.int64))
            rows = np.repeat(np.arange(b, dtype=np.int64), lens)
        sizes[name] = b
        out.append((values, rows))
    if len(set(sizes.values())) != 1:
        raise ValueError(f"features have different batch sizes: {sizes}")
    return out, next(iter(sizes.values()))


def _check_int(name: str, a: np.ndarray) -> None:
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"feature {name!r}: ids must be integers, got dtype {a.dtype}")
