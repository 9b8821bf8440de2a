"""Plain numpy/Python references of the fused ops, written independently of the kernels."""
import numpy as np


def segment_unique(keys, splits):
    """Dict-based per-segment unique: (unique, unique_splits, inverse, counts)."""
    unique, inverse, counts, out_splits = [], np.zeros(len(keys), np.int32), [], [0]
    for s in range(len(splits) - 1):
        seen = {}
        for i in range(splits[s], splits[s + 1]):
            k = int(keys[i])
            if k not in seen:
                seen[k] = len(unique)
                unique.append(k)
                counts.append(0)
            inverse[i] = seen[k]
            counts[seen[k]] += 1
        out_splits.append(len(unique))
    return (np.array(unique, dtype=np.asarray(keys).dtype), np.array(out_splits, np.int64),
            inverse, np.array(counts, np.int32))


def rankwise_sort(keys, splits, owners, num_ranks):
    """Stable sort by precomputed owners: (sorted, sorted_segs, rank_splits, indices)."""
    segs = np.repeat(np.arange(len(splits) - 1, dtype=np.int32), np.diff(splits))
    order = sorted(range(len(keys)), key=lambda i: (owners[i], i))
    indices = np.empty(len(keys), np.int32)
    indices[order] = np.arange(len(keys), dtype=np.int32)
    rank_splits = np.array([np.sum(owners == r) for r in range(num_ranks)], np.int32)
    return np.asarray(keys)[order], segs[order], rank_splits, indices


def pool(rows, recover, pool_splits, feature_splits, combiners):
    """Loop reference of RecoveryPool."""
    out = np.zeros((len(pool_splits) - 1, rows.shape[1]), rows.dtype)
    for f, comb in enumerate(combiners):
        for p in range(feature_splits[f], feature_splits[f + 1]):
            idx = recover[pool_splits[p]:pool_splits[p + 1]]
            if len(idx) == 0:
                continue
            total = rows[idx].sum(axis=0)
            out[p] = total if comb == "sum" else (
                total / len(idx) if comb == "mean" else total / np.sqrt(len(idx)))
    return out
