"""Sharded, push-based inference over a bounded-lag alltoallv (paper 001).

N ranks each hold only the rows they own (``restore_shard``: the training checkpoint
restored onto N ranks, owner = ``owner_rank(id, N)``, about 1/N of the rows each). For
every global batch each rank reads all IDs, looks up only its own keys (never-trained
keys get their deterministic initial row, as in training and serving) and pushes, to
the rank owning each sample (contiguous blocks ``sample_bounds``), partial pooled sums
and counts per (sample, feature), or for sequence features the rows with their
positions. The owner adds the partials, finishes sum/mean/sqrtn pooling exactly as the
single-host ``ServingGroup`` does, and runs the dense part of the unchanged model on its
samples. There is no request/response: a rank never waits for another rank's lookup,
only (through the exchange) for the partials of its own samples.

    predictor = ShardedPredictor(model, rank, size, BLSAlltoallv(MPI.COMM_WORLD, k, cap))
    for j, logits in run_bounded_lag(predictor, batches, k): ...   # this rank's samples
"""
import contextlib
import os
from typing import Callable, Iterable, Iterator, Optional, Tuple

import numpy as np
import tensorflow as tf

from tf_fusedemb.inference import distributed_payload as payload
from tf_fusedemb.layers.fused_embedding import fused_embedding_layers
from tf_fusedemb.layers.inputs import flatten_feature
from tf_fusedemb.ops import hashing


class RankInfo:
    """The part of a communicator that ``CheckpointManager.restore`` uses (rank, size):
    sharded inference never runs Horovod."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = int(rank), int(size)

    def watch(self, activity):
        del activity
        return contextlib.nullcontext()


def restore_shard(model, checkpoint_dir: str, rank: int, size: int, path=None) -> dict:
    """Restores this rank's share of a training checkpoint (dense weights in full, the
    embedding rows it owns under ``size`` ranks); returns the checkpoint's meta dict.
    ``model`` must be built (its variables created) first.

    Raises:
      FileNotFoundError: no directory, no complete checkpoint, or a missing shard file.
      ValueError: the checkpoint was written for another model (fusion plan).
    """
    from tf_fusedemb.training.checkpoint import CheckpointManager  # pylint: disable=import-outside-toplevel
    if not os.path.isdir(checkpoint_dir):
        raise FileNotFoundError(f"checkpoint directory {checkpoint_dir!r} does not exist")
    manager = CheckpointManager(checkpoint_dir, model, communicator=RankInfo(rank, size))
    try:
        meta = manager.restore(path)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"checkpoint in {checkpoint_dir!r} is incomplete: {e}") from e
    except ValueError as e:
        raise ValueError(f"checkpoint in {checkpoint_dir!r} does not match the model: {e}") from e
    if meta is None:
        raise FileNotFoundError(f"no complete checkpoint in {checkpoint_dir!r} (no 'latest' "
                                "pointer): train with --checkpoint-dir first")
    return meta


def sample_bounds(batch_size: int, size: int) -> np.ndarray:
    """int64[N+1]: rank q owns samples [bounds[q], bounds[q+1]) of a global batch."""
    return (np.arange(size + 1, dtype=np.int64) * batch_size) // size


def stored_rows(model) -> int:
    """Rows this rank holds in the model's FusedEmbedding tables (eager)."""
    return int(sum(int(g.table.size()) for layer in fused_embedding_layers(model)
                   for g in layer.groups if hasattr(g, "table")))


class _InjectedGroup:
    """Stands in for a GroupLookup inside the model: returns the embeddings the owner
    assembled from the pushed partials (set just before the dense part runs)."""

    def __init__(self, lookup):
        self.group, self.key_mode, self.table_names = (lookup.group, lookup.key_mode,
                                                       lookup.table_names)
        self.pending = None

    def __call__(self, flats, combiners, context=None, record_statistics=False):
        del flats, combiners, context, record_statistics
        return self.pending


class ShardedPredictor:
    """Push side and owner side of sharded inference for one rank.

    Args:
      model: a built, restored model with FusedEmbedding layers (switched in place: its
        layers' groups are replaced by injected embeddings; keep the model for this).
      rank, size: this rank and the number of ranks.
      exchange: ``start(j, sends: N uint8 arrays)`` / ``finish(j) -> N uint8 arrays``,
        e.g. :class:`~tf_fusedemb.comm.bls_alltoallv.BLSAlltoallv`.
    """

    def __init__(self, model, rank: int, size: int, exchange):
        self.model, self.rank, self.size, self.exchange = model, rank, size, exchange
        self._lookups, self._injected = [], []
        for layer in fused_embedding_layers(model):
            if any(isinstance(g, _InjectedGroup) for g in layer.groups):
                raise ValueError("this model already serves a ShardedPredictor: build one "
                                 "predictor per model (set its .exchange to switch)")
            injected = [_InjectedGroup(lookup) for lookup in layer.groups]
            self._lookups += list(layer.groups)
            self._injected += injected
            layer.groups = injected
        self.features = [f for g in self._lookups for f in g.group.features]
        self.dims = [f.dim for f in self.features]
        self._pending = {}
        self._dense = tf.function(self._dense_part, reduce_retracing=True)

    def stored_rows(self) -> int:
        """Rows this rank holds in its tables (eager)."""
        return int(sum(int(g.table.size()) for g in self._lookups))

    def capacity_bytes(self, global_batch: int) -> int:
        """Largest message of a global batch of ``global_batch`` samples: one entry per
        owner sample for a pooled feature, at most ``max_len`` for a sequence feature."""
        per_rank = -(-global_batch // self.size)
        entries = [per_rank * (f.max_len if f.is_sequence else 1) for f in self.features]
        return payload.capacity_bytes(entries, self.dims)

    # ---- push side ----------------------------------------------------------------------
    def push(self, j: int, batch) -> None:
        """Looks up this rank's keys of global batch ``j`` ({feature: IDs [B] | [B, L] |
        RaggedTensor}, dense features [B]) and pushes the partials to the owners."""
        blocks = [[] for _ in range(self.size)]
        splits = []
        batch_size = None
        for lookup in self._lookups:
            flats = [self._flatten(lookup, spec, batch) for spec in lookup.group.features]
            rows = self._owned_rows(lookup, flats)
            for spec, (ids, row_splits, owned), own_rows in zip(lookup.group.features, flats, rows):
                batch_size = len(row_splits) - 1 if batch_size is None else batch_size
                if len(row_splits) - 1 != batch_size:
                    raise ValueError(f"sharded inference: feature '{spec.name}' has "
                                     f"{len(row_splits) - 1} samples, others {batch_size}")
                splits.append(row_splits)
                for q, block in enumerate(self._partials(spec, row_splits, owned, own_rows)):
                    blocks[q].append(block)
        bounds = sample_bounds(batch_size or 0, self.size)
        lo, hi = int(bounds[self.rank]), int(bounds[self.rank + 1])
        self._pending[j] = ({name: _rows(value, lo, hi) for name, value in batch.items()},
                            [s[lo:hi + 1] - s[lo] for s in splits])
        self.exchange.start(j, [payload.pack(b) for b in blocks])

    def _flatten(self, lookup, spec, batch):
        """(ids int64[n], row_splits int64[B+1], owned bool[n]) of one feature."""
        id_bits = None
        if lookup.key_mode == "packed" and not lookup.group.is_static:
            id_bits = hashing.default_id_bits(len(lookup.table_names))
        if spec.name not in batch:
            raise ValueError(f"sharded inference: the batch lacks feature '{spec.name}'")
        value = batch[spec.name]
        if id_bits is None and not lookup.group.is_static and _is_plain(value):
            # Fast path (no ID range to check): the IDs as they are, in numpy.
            ids = np.asarray(value).astype(np.int64).reshape(-1)
            row_splits = np.arange(len(ids) + 1, dtype=np.int64)
        elif id_bits is None and not lookup.group.is_static and isinstance(value, tf.RaggedTensor) \
                and value.ragged_rank == 1 and value.shape.rank == 2:
            ids = value.flat_values.numpy().astype(np.int64)
            row_splits = value.row_splits.numpy().astype(np.int64)
        else:  # validated flattening (dense [B, L], sparse, static or packed keys)
            flat = flatten_feature(spec, value, id_bits)
            ids, row_splits = flat.ids.numpy().astype(np.int64), flat.row_splits.numpy()
        return ids, row_splits, hashing.owner_rank(ids, self.size) == self.rank

    def _owned_rows(self, lookup, flats):
        """Per feature float32[n_owned, dim]: this rank's rows of its own keys, one table
        lookup for the whole group (init rows for keys never trained)."""
        group = lookup.group
        ids = np.concatenate([f[0][f[2]] for f in flats])
        tables = np.concatenate([np.full(int(f[2].sum()), group.table_index[i], np.int64)
                                 for i, f in enumerate(flats)])
        hashed = lookup.hashed_keys(tf.constant(ids), tf.constant(tables))
        if group.is_static:
            sizes = [t.vocabulary_size for t in group.tables]
            offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
            keys = tf.constant(offsets[tables] + ids)
        elif lookup.key_mode == "packed":
            keys = tf.constant(hashing.packed_unified_keys(ids, tables, len(lookup.table_names)))
        else:
            keys = hashed
        rows = lookup.table.lookup(keys, hashed).numpy()
        ends = np.cumsum([int(f[2].sum()) for f in flats])
        return np.split(rows, ends[:-1])

    def _partials(self, spec, row_splits, owned, rows):
        """One payload block per destination rank for one feature."""
        batch_size = len(row_splits) - 1
        bounds = sample_bounds(batch_size, self.size)
        sample = np.repeat(np.arange(batch_size), np.diff(row_splits))[owned]
        if spec.is_sequence:  # rows travel as they are, with their positions
            position = np.flatnonzero(owned)
            dest = np.searchsorted(bounds, sample, side="right") - 1
            for q in range(self.size):
                sel = dest == q
                yield (position[sel] - row_splits[bounds[q]], np.ones(int(sel.sum()), np.int64),
                       rows[sel].astype(np.float64))
            return
        sums = np.zeros((batch_size, spec.dim), np.float64)
        np.add.at(sums, sample, rows.astype(np.float64))
        counts = np.bincount(sample, minlength=batch_size).astype(np.int64)
        for q in range(self.size):
            lo, hi = bounds[q], bounds[q + 1]
            touched = np.flatnonzero(counts[lo:hi])
            yield touched, counts[lo:hi][touched], sums[lo:hi][touched]

    # ---- owner side ---------------------------------------------------------------------
    def complete(self, j: int) -> np.ndarray:
        """Logits float32[B_r] of this rank's samples of batch ``j`` (after ``push(j)``)."""
        received = self.exchange.finish(j)
        features, splits = self._pending.pop(j)
        blocks = [payload.unpack(m, self.dims) for m in received]
        embeddings, f = [], 0
        for lookup in self._lookups:
            group_embs = []
            for spec in lookup.group.features:
                group_embs.append(self._assemble(spec, splits[f], [b[f] for b in blocks]))
                f += 1
            embeddings.append(group_embs)
        return self._dense(features, embeddings).numpy().reshape(-1)

    def _assemble(self, spec, row_splits, parts):
        """The feature's embeddings for this rank's samples from every rank's block."""
        batch_size, n = len(row_splits) - 1, int(row_splits[-1])
        if spec.is_sequence:
            rows = np.zeros((n, spec.dim), np.float32)
            filled = np.zeros(n, np.int64)
            for index, _, values in parts:
                rows[index] = values.astype(np.float32)  # exact: float32 rows widened
                filled[index] += 1
            _check_complete(spec, filled, np.ones(n, np.int64))
            return tf.constant(rows)
        total = np.zeros((batch_size, spec.dim), np.float64)
        count = np.zeros(batch_size, np.int64)
        for index, cnt, values in parts:
            total[index] += values  # unique indices per sender
            count[index] += cnt
        _check_complete(spec, count, np.diff(row_splits))
        pooled = total.astype(np.float32)
        denominator = np.maximum(count, 1).astype(np.float32)[:, None]
        if spec.combiner == "mean":  # as ServingGroup: float32 division by max(count, 1)
            pooled = pooled / denominator
        elif spec.combiner == "sqrtn":
            pooled = pooled / np.sqrt(denominator)
        return tf.constant(pooled)

    def _dense_part(self, features, embeddings):
        for injected, embs in zip(self._injected, embeddings):
            injected.pending = list(embs)
        return self.model(features, training=False)


def _is_plain(value):
    """A dense 1-D tensor or array of integer IDs (one per sample)."""
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    return (isinstance(value, (tf.Tensor, np.ndarray)) and shape is not None and
            len(shape) == 1 and np.dtype(getattr(dtype, "as_numpy_dtype", dtype)).kind in "iu")


def _rows(value, lo, hi):
    """Samples [lo, hi) of one input (dense tensors sliced in numpy: cheaper per batch
    than an eager slice op)."""
    if isinstance(value, (tf.Tensor, np.ndarray)):
        return np.asarray(value)[lo:hi]
    return value[lo:hi]


def _check_complete(spec, got, expected):
    if not np.array_equal(got, expected):
        bad = int(np.flatnonzero(got != expected)[0])
        raise RuntimeError(f"sharded inference: feature '{spec.name}', entry {bad}: partials "
                           f"of {int(got[bad])} IDs arrived, {int(expected[bad])} expected; "
                           "the ranks read different batches or restored different shards")


def run_bounded_lag(predictor: ShardedPredictor, batches: Iterable, lag: int,
                    before_push: Optional[Callable[[int], None]] = None
                    ) -> Iterator[Tuple[int, np.ndarray]]:
    """Pushes batch j, then completes batch j - lag (the BLS schedule; lag 0 is
    synchronous); yields (j, logits of this rank's samples) in batch order.
    ``before_push(j)`` runs first in each iteration (e.g. an injected delay)."""
    j = 0
    for batch in batches:
        if before_push is not None:
            before_push(j)
        predictor.push(j, batch)
        if j - lag >= 0:
            yield j - lag, predictor.complete(j - lag)
        j += 1
    for i in range(max(0, j - lag), j):
        yield i, predictor.complete(i)
