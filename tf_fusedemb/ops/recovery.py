"""Recovery (FusedRec step c.1): from received rows back to per-feature embeddings.

``recovery_gather`` builds I_r = I_s[I_u] and gathers the rows in one kernel;
``recovery_pool`` gathers and pools (sum/mean/sqrtn) per sample for a whole group in
one kernel; ``recover_features`` is what a layer calls for one fused group.
"""
from typing import List, NamedTuple, Optional, Sequence, Tuple, Union

import tensorflow as tf

from tf_fusedemb.ops import _loader, _validate
from tf_fusedemb.ops._validate import TensorLike
from tf_fusedemb.ops.sorted_search import search_sorted
from tf_fusedemb.ops.static_sizes import IntLike, stack_ints
from tf_fusedemb.specs import COMBINERS


class UniformSplits(NamedTuple):
    """A feature whose every sample has ``ids_per_sample`` L IDs: ``num_ids`` n of them
    (a Python int when known at trace time, else an int64 scalar), so B = n / L samples
    (its row splits are 0, L, 2L, ..., n)."""
    ids_per_sample: int
    num_ids: IntLike


# How a feature's IDs split into samples: row splits int64[B+1], or UniformSplits.
SampleSplits = Union[tf.Tensor, UniformSplits]


def recovery_gather(rows: TensorLike, sort_indices: TensorLike, unique_inverse: TensorLike,
                    name: Optional[str] = None) -> Tuple[tf.Tensor, tf.Tensor]:
    """Rows of the fused layout from the received rank-sorted rows.

    Args:
      rows: float32/float64[m, D] rows received from the owners, in rank-sorted order.
      sort_indices: int32[u], the paper's I_s (``rankwise_sort(...).indices``).
      unique_inverse: int32[n], the paper's I_u (``segment_unique(...).inverse``).

    Returns:
      (output: [n, D] with ``output[i] = rows[sort_indices[unique_inverse[i]]]``,
      recover_indices: int32[n], I_r). The gradient w.r.t. ``rows`` is the unsorted
      segment sum of the output gradient by I_r.
    """
    with tf.name_scope(name or "recovery_gather"):
        rows = _validate.float_tensor(rows, "rows")
        sort_indices = _validate.int_tensor(sort_indices, tf.int32, "sort_indices")
        unique_inverse = _validate.int_tensor(unique_inverse, tf.int32, "unique_inverse")
        return _loader.raw_op("RecoveryGather")(rows, sort_indices, unique_inverse)


def recovery_pool(rows: TensorLike, recover_indices: TensorLike, pool_splits: TensorLike,
                  feature_pool_splits: TensorLike, combiners: Sequence[str],
                  name: Optional[str] = None) -> tf.Tensor:
    """Gather and pool the rows of all features of a group in one kernel.

    Args:
      rows: float32/float64[m, D] received rows.
      recover_indices: int32[n], I_r.
      pool_splits: int64[P+1] row splits of the P pooled outputs over the n keys.
      feature_pool_splits: int64[F+1] row splits of the F features over the P outputs.
      combiners: F strings in ('sum', 'mean', 'sqrtn'); empty segments give zeros.

    Returns:
      float[P, D] pooled rows; differentiable w.r.t. ``rows``.
    """
    combiners = list(combiners)
    for i, c in enumerate(combiners):
        if c not in COMBINERS:
            raise _validate.invalid(f"combiners[{i}] = {c!r} is not one of {COMBINERS}")
    with tf.name_scope(name or "recovery_pool"):
        rows = _validate.float_tensor(rows, "rows")
        rec = _validate.int_tensor(recover_indices, tf.int32, "recover_indices")
        splits = _validate.int_tensor(pool_splits, tf.int64, "pool_splits")
        fsplits = _validate.int_tensor(feature_pool_splits, tf.int64, "feature_pool_splits")
        return _loader.raw_op("RecoveryPool")(rows, rec, splits, fsplits, combiners=combiners)


def finish_pooling(total: TensorLike, count: TensorLike, combiner: str) -> tf.Tensor:
    """Pooled rows float32[B, dim] from each sample's row sum ``total`` float32[B, dim] and
    ID count ``count`` float32[B]: ``sum`` as is, ``mean`` divided by max(count, 1),
    ``sqrtn`` by its square root (an empty sample pools to zeros). The serving paths (one
    host, and sharded across ranks) pool with it, so both give the same floats."""
    if combiner not in COMBINERS:
        raise ValueError(f"unknown combiner {combiner!r}; choose from {COMBINERS}")
    total = tf.convert_to_tensor(total, tf.float32)
    denominator = tf.maximum(tf.convert_to_tensor(count, tf.float32), 1.0)[:, None]
    if combiner == "mean":
        return total / denominator
    if combiner == "sqrtn":
        return total / tf.sqrt(denominator)
    return total


def recover_features(rows: TensorLike, sort_indices: TensorLike, unique_inverse: TensorLike,
                     feature_row_splits: Sequence[SampleSplits],
                     combiners: Sequence[Optional[str]]) -> List[tf.Tensor]:
    """Per-feature embeddings of one fused group, with one pooling kernel for the group.

    Args:
      rows: float[m, D] received rows (rank-sorted order).
      sort_indices: int32[u] I_s.  unique_inverse: int32[n] I_u.
      feature_row_splits: F int64 tensors; feature f's keys are the next ``rs_f[-1]``
        keys of the fused order and ``rs_f`` [B_f+1] splits them per sample. A
        ``UniformSplits`` stands for the splits of a feature with L keys per sample.
      combiners: F entries, 'sum' | 'mean' | 'sqrtn' to pool, or None to keep one row
        per key (one-hot or sequence features).

    Returns:
      F tensors: [B_f, D] for pooled features, [n_f, D] for the others.
    """
    if len(feature_row_splits) != len(combiners):
        raise _validate.invalid(f"{len(feature_row_splits)} feature_row_splits but "
                                f"{len(combiners)} combiners")
    rec = tf.gather(_validate.int_tensor(sort_indices, tf.int32, "sort_indices"),
                    _validate.int_tensor(unique_inverse, tf.int32, "unique_inverse"))
    pool_splits, sizes = group_pool_splits(feature_row_splits, combiners)
    feature_splits = tf.concat([tf.zeros([1], tf.int64), tf.cumsum(sizes)], axis=0)
    pooled = recovery_pool(rows, rec, pool_splits, feature_splits,
                           [c or "sum" for c in combiners])
    return tf.split(pooled, sizes, axis=0, num=len(combiners))


def group_pool_splits(feature_row_splits: Sequence[SampleSplits],
                      combiners: Sequence[Optional[str]]) -> Tuple[tf.Tensor, tf.Tensor]:
    """(pool_splits int64[1 + sum B_f], sizes int64[F]): the features' samples as one
    list of segments over the group's keys in fused order (feature f's row splits shifted
    by the keys of the features before it; a feature without a combiner has one segment
    per key), and each feature's segment count B_f (n_f without a combiner).

    Vectorized over the features: a feature given as ``UniformSplits`` costs no op of its
    own beyond its size, a ragged one two, so the step's graph stays small however many
    features a group fuses."""
    uniform = [_as_uniform(s, c) for s, c in zip(feature_row_splits, combiners)]
    ragged = [tf.cast(s, tf.int64) for s, u in zip(feature_row_splits, uniform) if u is None]
    num_ids = stack_ints([u.num_ids if u else rs[-1] for u, rs in _zip_ragged(uniform, ragged)])
    sizes = stack_ints([_uniform_size(u) if u else tf.size(rs, out_type=tf.int64) - 1
                        for u, rs in _zip_ragged(uniform, ragged)])  # B_f
    ends = tf.cumsum(sizes)
    # Kept split j (every feature's row splits but the leading 0, in order) is sample k
    # of feature f = #{ends <= j}: its value is (k + 1) L_f, or rs_f[k + 1] if ragged.
    kept = tf.range(ends[-1], dtype=tf.int64)
    feature = search_sorted(ends, kept, side="right", out_type=tf.int64)
    sample = kept - tf.gather(ends - sizes, feature)
    per_sample = [u.ids_per_sample if u else 0 for u in uniform]
    value = sample + 1
    if any(length != 1 for length in per_sample):
        value *= tf.gather(tf.constant(per_sample, tf.int64), feature)
    if ragged:
        flat = tf.concat(ragged, axis=0)
        lengths = [tf.size(rs, out_type=tf.int64) for rs in ragged]
        starts = iter(tf.unstack(tf.cumsum(tf.stack(lengths), exclusive=True)))
        start = tf.stack([tf.zeros([], tf.int64) if u else next(starts) for u in uniform])
        of_ragged = tf.gather(tf.constant([u is None for u in uniform]), feature)
        # Position in ``flat`` of a ragged feature's split (0 for the others: in range).
        at = tf.where(of_ragged, tf.gather(start, feature) + sample + 1, tf.zeros_like(sample))
        value = tf.where(of_ragged, tf.gather(flat, at), value)
    keys_before = tf.cumsum(num_ids, exclusive=True)
    pool_splits = tf.concat([tf.zeros([1], tf.int64), value + tf.gather(keys_before, feature)],
                            axis=0)
    return pool_splits, sizes


def _as_uniform(splits: SampleSplits, combiner: Optional[str]) -> Optional[UniformSplits]:
    """``splits`` as UniformSplits where they are uniform: given so, or a feature without
    a combiner (one segment per key); None for a pooled ragged feature."""
    if isinstance(splits, UniformSplits):
        return splits if combiner is not None else UniformSplits(1, splits.num_ids)
    if combiner is None:
        return UniformSplits(1, tf.cast(splits, tf.int64)[-1])
    return None


def _uniform_size(u: UniformSplits) -> IntLike:
    """B = n / L of a uniform feature."""
    return u.num_ids if u.ids_per_sample == 1 else u.num_ids // u.ids_per_sample


def _zip_ragged(uniform: Sequence[Optional[UniformSplits]], ragged: Sequence[tf.Tensor]):
    """(uniform, None) or (None, its row splits) per feature, in feature order."""
    rest = iter(ragged)
    return [(u, None) if u else (None, next(rest)) for u in uniform]


@tf.RegisterGradient("FusedEmb>RecoveryGather")
def _recovery_gather_grad(op, grad_output, _grad_indices):
    rows = op.inputs[0]
    rows_grad = tf.math.unsorted_segment_sum(grad_output, op.outputs[1], tf.shape(rows)[0])
    return rows_grad, None, None


@tf.RegisterGradient("FusedEmb>RecoveryPool")
def _recovery_pool_grad(op, grad):
    rows, rec, splits, fsplits = op.inputs
    rows_grad = _loader.raw_op("RecoveryPoolGrad")(
        grad, rec, splits, fsplits, tf.shape(rows, out_type=tf.int32)[0],
        combiners=op.get_attr("combiners"))
    return rows_grad, None, None, None


tf.no_gradient("FusedEmb>RecoveryPoolGrad")
