"""``cluster_dataset``: key-centric sample clustering as a tf.data transform (NestPipe,
section V-C: asynchronous, on the CPU, in the data stage). Each batch's samples are
reordered by :func:`tf_fusedemb.pipeline.clustering.cluster_permutation`, computed in a
parallel, deterministic map and prefetched, so it runs ahead of the training step."""
from typing import Any, List, Mapping, Optional, Sequence

import tensorflow as tf

from tf_fusedemb.pipeline.clustering import RaggedIds, cluster_permutation

__all__ = ["cluster_dataset"]


def cluster_dataset(dataset: tf.data.Dataset, feature_names: Sequence[str],
                    num_micro_batches: int, num_parallel_calls: Optional[int] = None,
                    seed: int = 0) -> tf.data.Dataset:
    """tf.data transform: reorders the samples of every batch by `cluster_permutation`.

    The permutation is computed on the CPU by `tf.numpy_function` from the named features, then
    EVERY tensor of the element (all features, the label, the sample weight) is gathered by it,
    so each sample keeps its label and weight. The map is parallel but deterministic, and the
    result is prefetched, so the clustering runs asynchronously ahead of the training step.

    Args:
      dataset: a tf.data.Dataset of batches: `(x, y)`, `(x, y, sample_weight)` or a bare `x`,
        where x is a dict of tensors of leading dimension B; y / sample_weight may be tensors
        or nests of tensors of leading dimension B ([B], [B, 1], ...).
      feature_names: keys of x to cluster on (e.g. "C1".."C26"); each an integer or string
        tensor [B] or [B, k], or a tf.RaggedTensor [B, None] (multi-hot). Strings are hashed
        with tf.strings.to_hash_bucket_fast first.
      num_micro_batches: N >= 1, the frozen-window micro-batches per batch (1: no reordering,
        the dataset is returned prefetched).
      num_parallel_calls: parallelism of the map; None = tf.data.AUTOTUNE.
      seed: passed to cluster_permutation.
    Returns:
      dataset with the same element_spec, each batch permuted: x'[j] = x[perm[j]] for every
      tensor of the element.
    Raises:
      ValueError: a named feature is missing from x, feature_names is empty, x is not a dict,
        num_micro_batches < 1.
      TypeError: an element tensor is a tf.SparseTensor (not supported by tf.gather), or a
        named feature is neither integer nor string.
    """
    n = int(num_micro_batches)
    if n < 1:
        raise ValueError(f"num_micro_batches must be >= 1, got {num_micro_batches}")
    names = list(feature_names)
    if not names:
        raise ValueError("feature_names is empty: need at least one feature to cluster on")
    x_spec = _features_spec(dataset.element_spec, names)
    if n == 1:
        return dataset.prefetch(tf.data.AUTOTUNE)
    parallel = tf.data.AUTOTUNE if num_parallel_calls is None else num_parallel_calls
    out = dataset.map(_BatchPermutation(names, x_spec, n, seed), num_parallel_calls=parallel,
                      deterministic=True)
    # Prefetch so the (CPU) clustering of the next batches overlaps the training step.
    return out.prefetch(tf.data.AUTOTUNE)


def _features_spec(spec: Any, names: List[str]) -> Mapping[str, Any]:
    """The spec of x of elements ``spec``, checked: x a dict holding every named integer or
    string feature (ragged only [B, None]), and no sparse tensor anywhere."""
    if isinstance(spec, Mapping):
        x_spec = spec
    elif isinstance(spec, tuple) and len(spec) in (2, 3) and isinstance(spec[0], Mapping):
        x_spec = spec[0]
    else:
        raise ValueError("cluster_dataset expects elements (x, y), (x, y, sample_weight) or x "
                         f"with x a dict of tensors; got element_spec {spec}")
    for name in names:
        if name not in x_spec:
            raise ValueError(f"feature {name!r} to cluster on is not in the batch (features: "
                             f"{sorted(x_spec)})")
        s = x_spec[name]
        if not isinstance(s, (tf.TensorSpec, tf.RaggedTensorSpec)):
            raise TypeError(f"feature {name!r}: expected a tensor or tf.RaggedTensor, got {s}")
        if not (s.dtype.is_integer or s.dtype == tf.string):
            raise TypeError(f"feature {name!r}: ids must be integers or strings, got {s.dtype}")
        if isinstance(s, tf.RaggedTensorSpec) and s.ragged_rank != 1:
            raise ValueError(f"feature {name!r}: only ragged [B, None] (ragged_rank 1) is "
                             f"supported, got ragged_rank {s.ragged_rank}")
    for s in tf.nest.flatten(spec):
        if isinstance(s, tf.SparseTensorSpec):
            raise TypeError("cluster_dataset cannot reorder tf.SparseTensor elements (tf.gather "
                            "does not take them); use dense or ragged tensors")
    return x_spec


class _BatchPermutation:
    """The map function: one batch's element -> the same element with its samples in
    ``cluster_permutation`` order (every tensor gathered by it)."""

    def __init__(self, names: List[str], x_spec: Mapping[str, Any], n: int, seed: int):
        self.names, self.x_spec, self.n, self.seed = names, x_spec, n, seed
        self.ragged = [isinstance(x_spec[name], tf.RaggedTensorSpec) for name in names]

    def permutation(self, *arrays: Any) -> Any:
        """int64[B] from the features' arrays: per feature the ids, or (flat ids,
        row_splits) of a ragged one (handed over as RaggedIds, so B small per-sample arrays
        are never built)."""
        feats, i = {}, 0
        for name, is_ragged in zip(self.names, self.ragged):
            if is_ragged:
                feats[name] = RaggedIds(arrays[i], arrays[i + 1])
                i += 2
            else:
                feats[name] = arrays[i]
                i += 1
        return cluster_permutation(feats, self.n, self.seed)

    def __call__(self, *element: Any) -> Any:
        x = element[0]  # a bare dict element arrives as the only argument
        inputs = []
        for name, is_ragged in zip(self.names, self.ragged):
            t = x[name]
            inputs += [_as_ids(t.flat_values), t.row_splits] if is_ragged else [_as_ids(t)]
        perm = tf.numpy_function(self.permutation, inputs, tf.int64, stateful=False)
        perm.set_shape(self.x_spec[self.names[0]].shape[:1])
        # Every tensor of the element, labels and weights included, follows the same order.
        permuted = tf.nest.map_structure(lambda t: tf.gather(t, perm), element)
        return permuted[0] if len(element) == 1 else permuted


def _as_ids(t: tf.Tensor) -> tf.Tensor:
    if t.dtype == tf.string:
        return tf.strings.to_hash_bucket_fast(t, 2 ** 62)
    return tf.cast(t, tf.int64)
