"""Sharded, push-based inference over a bounded-lag alltoallv (paper 001).

N ranks each hold only the rows they own (``restore_shard``: the training checkpoint
restored onto N ranks, owner = ``owner_rank(id, N)``, about 1/N of the rows each). The
model must be built inside ``for_rank(rank, N)``: its tables are then created for rank
``rank`` of N, so a static-vocabulary table allocates only its own ~V/N rows (dynamic
tables grow with what is restored either way). For
every global batch each rank reads all IDs, looks up only its own keys (never-trained
keys get their deterministic initial row, as in training and serving) and pushes, to
the rank owning each sample (contiguous blocks ``sample_bounds``), partial pooled sums
and counts per (sample, feature), or for sequence features the rows with their
positions. The owner adds the partials, finishes sum/mean/sqrtn pooling exactly as the
single-host ``ServingGroup`` does, and runs the dense part of the unchanged model on its
samples. There is no request/response: a rank never waits for another rank's lookup,
only (through the exchange) for the partials of its own samples.

    with for_rank(rank, size, MPI.COMM_WORLD):
        model = build_model()
    restore_shard(model, checkpoint_dir, rank, size)
    predictor = ShardedPredictor(model, rank, size, BLSAlltoallv(MPI.COMM_WORLD, k, cap))
    for j, logits in run_bounded_lag(predictor, batches, k): ...   # this rank's samples

Inputs per feature: int IDs [B] or [B, L], RaggedTensor [B, None] or SparseTensor [B, L]
(as ``FusedEmbedding``); a sequence longer than the feature's ``max_len`` is an error
naming the feature (``max_len`` sizes the exchange's slots).
"""
import os
from typing import (Any, Callable, ContextManager, Dict, Iterable, Iterator, List, Mapping,
                    Optional, Protocol, Sequence, Tuple)

import numpy as np
import tensorflow as tf
import tf_keras

from tf_fusedemb.comm.communicator import Communicator, communicator_scope
from tf_fusedemb.comm.counters import CommCounters
from tf_fusedemb.comm.topology import Topology
from tf_fusedemb.inference import distributed_payload as payload
from tf_fusedemb.layers.model_embeddings import ModelEmbeddings
from tf_fusedemb.layers.inputs import flatten_feature
from tf_fusedemb.layers.lookup_context import LookupContext
from tf_fusedemb.ops import hashing
from tf_fusedemb.ops.recovery import finish_pooling
from tf_fusedemb.training.checkpoint import CheckpointManager


class InferenceCommunicator(Communicator):
    """The communicator of a model built for sharded inference: rank ``rank`` of ``size``
    on one flat node, never Horovod. Tables created under it hold rank ``rank``'s rows
    only, and ``CheckpointManager.restore`` restores that share. ``allgather_object`` (the
    layer's check that every rank has the same features) goes through ``mpi_comm`` (an
    mpi4py communicator) when given, else it is skipped. It has no collective lookups:
    :class:`ShardedPredictor` replaces them by the push exchange. Only the call on an
    empty batch that creates a model's variables runs the layer's own lookup: its
    AlltoAlls send nothing and receive nothing; one that would send IDs is an error."""

    def __init__(self, rank: int, size: int, mpi_comm: Any = None):
        self.rank, self.size = int(rank), int(size)
        self.topology = Topology(self.rank, self.size, 1)
        self._mpi_comm = mpi_comm

    def allgather_object(self, obj: Any) -> List[Any]:
        if self._mpi_comm is None:
            return [obj] * self.size
        return self._mpi_comm.allgather(obj)

    def alltoall(self, tensor: tf.Tensor, splits: tf.Tensor, name: str,
                 counters: Optional[CommCounters] = None,
                 members: Optional[Sequence[int]] = None) -> Tuple[tf.Tensor, tf.Tensor]:
        del counters, members
        splits = tf.cast(splits, tf.int32)
        check = tf.debugging.assert_equal(
            tf.reduce_sum(splits), 0, message=f"{name}: {_NO_COLLECTIVE}")
        with tf.control_dependencies([check]):
            return tf.identity(tensor[:0]), tf.zeros_like(splits)

    def _no_collective(self, *args, **kwargs):
        raise RuntimeError(_NO_COLLECTIVE)

    allreduce_sum = allreduce_sum_list = allgather = _no_collective


_NO_COLLECTIVE = ("a model built for sharded inference makes no collective lookup (only "
                  "its variables are created on an empty batch): predict through "
                  "ShardedPredictor (tf_fusedemb.inference.distributed)")


def for_rank(rank: int, size: int, mpi_comm: Any = None) -> ContextManager[Communicator]:
    """Context manager: models (their FusedEmbedding layers) built inside it belong to
    rank ``rank`` of ``size`` (:class:`InferenceCommunicator`), so each static table
    creates only that rank's rows. Needed by every rank of sharded inference whose model
    code takes no communicator argument, e.g. ``with for_rank(r, n, MPI.COMM_WORLD): model
    = job.make_model(...)``."""
    return communicator_scope(InferenceCommunicator(rank, size, mpi_comm))


def check_sharded(model: tf_keras.Model, rank: int, size: int) -> None:
    """Raises ValueError when a static table of ``model`` was not built for rank ``rank``
    of ``size`` (built outside :func:`for_rank`, it would allocate every row of its
    vocabulary on every rank, or rows another rank owns)."""
    for layer in ModelEmbeddings.of(model).layers:
        for lookup in layer.groups:
            if not lookup.group.is_static:
                continue
            built_rank, built_size, vocabulary = lookup.store.static_shard()
            if (built_rank, built_size) != (rank, size):
                raise ValueError(
                    f"sharded inference: static group '{lookup.group.name}' of layer "
                    f"'{layer.name}' was built for rank {built_rank} of {built_size} "
                    f"(holding about 1/{built_size} of its "
                    f"{vocabulary} rows), but this is rank {rank} of {size}: "
                    "build the model inside tf_fusedemb.inference.distributed.for_rank"
                    f"({rank}, {size}) so each rank holds only its own rows")


def restore_shard(model: tf_keras.Model, checkpoint_dir: str, rank: int, size: int,
                  path: Optional[str] = None) -> dict:
    """Restores this rank's share of a training checkpoint (dense weights in full, the
    embedding rows it owns under ``size`` ranks); returns the checkpoint's meta dict.
    ``model`` must be built (its variables created) first.

    Raises:
      FileNotFoundError: no directory, no complete checkpoint, or a missing shard file.
      ValueError: the checkpoint was written for another model (fusion plan), or a static
        table of ``model`` was not built for this rank (:func:`check_sharded`).
    """
    if not os.path.isdir(checkpoint_dir):
        raise FileNotFoundError(f"checkpoint directory {checkpoint_dir!r} does not exist")
    check_sharded(model, rank, size)
    manager = CheckpointManager(checkpoint_dir, model,
                                communicator=InferenceCommunicator(rank, size))
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


def stored_rows(model: tf_keras.Model) -> int:
    """Rows this rank holds in the model's FusedEmbedding tables: written (trained or
    restored) rows, as a checkpoint counts them (eager)."""
    return _stored_rows(ModelEmbeddings.of(model).stores)


def resident_rows(model: tf_keras.Model) -> int:
    """Rows this rank's tables occupy in memory: a static table's allocated rows (all it
    owns, written or not), a dynamic table's stored rows (eager)."""
    return _resident_rows(ModelEmbeddings.of(model).stores)


def _stored_rows(stores):
    return sum(g.num_stored_rows() for g in stores)


def _resident_rows(stores):
    return sum(g.num_resident_rows() for g in stores)


class _PushedEmbeddings:
    """A ``GroupEmbeddings`` substitute for one group in one forward pass
    (``LookupContext.substitutes``): ``embeddings``, the group's per-feature embeddings
    the owner assembled from the pushed partials."""
    defers_range_check = False  # the layer checks the IDs (the owners' reads did too)

    def __init__(self, lookup, embeddings):
        self.group, self.key_mode, self.table_names = (lookup.group, lookup.key_mode,
                                                       lookup.table_names)
        self.embeddings = list(embeddings)

    def __call__(self, flats, combiners, context=None, record_statistics=False, marker=None):
        del flats, combiners, context, record_statistics, marker  # nothing trains
        return self.embeddings


class PushExchange(Protocol):
    """What :class:`ShardedPredictor` pushes through, e.g.
    :class:`~tf_fusedemb.comm.bls_alltoallv.BLSAlltoallv`: iteration ``j``'s N uint8
    messages out, then the N received."""

    def start(self, j: int, sends: Sequence[np.ndarray]) -> None: ...

    def finish(self, j: int) -> List[np.ndarray]: ...


class ShardedPredictor:
    """Push side and owner side of sharded inference for one rank.

    Args:
      model: a model with FusedEmbedding layers, built inside :func:`for_rank` and
        restored. Its layers are not changed: the dense part runs on the pushed
        embeddings through a LookupContext, so one model may serve several predictors.
      rank, size: this rank and the number of ranks.
      exchange: ``start(j, sends: N uint8 arrays)`` / ``finish(j) -> N uint8 arrays``,
        e.g. :class:`~tf_fusedemb.comm.bls_alltoallv.BLSAlltoallv`; None: set ``exchange``
        before the first :meth:`push` (its capacity may come from :meth:`capacity_bytes`).

    Raises:
      ValueError: a static table of ``model`` was not built for this rank (see
        :func:`check_sharded`).
    """

    def __init__(self, model: tf_keras.Model, rank: int, size: int,
                 exchange: Optional[PushExchange]):
        check_sharded(model, rank, size)
        self.model, self.rank, self.size, self.exchange = model, rank, size, exchange
        self._embeddings = ModelEmbeddings.of(model)
        self._lookups = self._embeddings.lookups
        self.features = [f for g in self._lookups for f in g.group.features]
        self.dims = [f.dim for f in self.features]
        # batch j -> (this rank's rows of its features, their row splits per pooled feature)
        self._pending: Dict[int, Tuple[Dict[str, Any], List[np.ndarray]]] = {}
        self._dense = tf.function(self._dense_part, reduce_retracing=True)
        self.max_batch: Optional[int] = None  # the global batch the exchange's capacity was sized for

    def _exchange(self) -> PushExchange:
        if self.exchange is None:  # e.g. serve.py sizes it by capacity_bytes, then sets it
            raise ValueError("ShardedPredictor: set its exchange before pushing")
        return self.exchange

    def stored_rows(self) -> int:
        """Written rows this rank holds in its tables (see :func:`stored_rows`, eager)."""
        return _stored_rows(self._embeddings.stores)

    def resident_rows(self) -> int:
        """Rows this rank's tables occupy in memory (see :func:`resident_rows`, eager)."""
        return _resident_rows(self._embeddings.stores)

    def capacity_bytes(self, global_batch: int) -> int:
        """Largest message of a global batch of ``global_batch`` samples: one entry per
        owner sample for a pooled feature, at most ``max_len`` for a sequence feature.
        Later batches larger than ``global_batch`` are refused by :meth:`push`."""
        self.max_batch = int(global_batch)
        per_rank = -(-global_batch // self.size)
        entries = [per_rank * (f.max_len if f.is_sequence else 1) for f in self.features]
        return payload.capacity_bytes(entries, self.dims)

    # ---- push side ----------------------------------------------------------------------
    def push(self, j: int, batch: Mapping[str, Any]) -> None:
        """Looks up this rank's keys of global batch ``j`` ({feature: IDs [B] | [B, L] |
        RaggedTensor [B, None] | SparseTensor [B, L]}, dense features [B]) and pushes the
        partials to the owners.

        Raises:
          ValueError: naming the feature: a missing feature, features of different batch
            sizes, a sequence longer than its ``max_len``, a batch larger than the one
            the capacity was sized for, invalid IDs (as ``FusedEmbedding``).
        """
        blocks: List[List[payload.Block]] = [[] for _ in range(self.size)]  # per owner rank
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
                self._check_fits(j, spec, row_splits)
                splits.append(row_splits)
                for q, block in enumerate(self._partials(spec, row_splits, owned, own_rows)):
                    blocks[q].append(block)
        bounds = sample_bounds(batch_size or 0, self.size)
        lo, hi = int(bounds[self.rank]), int(bounds[self.rank + 1])
        self._pending[j] = ({name: _rows(value, lo, hi) for name, value in batch.items()},
                            [s[lo:hi + 1] - s[lo] for s in splits])
        self._exchange().start(j, [payload.pack(b) for b in blocks])

    def _check_fits(self, j, spec, row_splits):
        """The feature's entries fit the slots sized by :meth:`capacity_bytes` (sequence
        lengths were checked before flattening, by ``_check_sequence_lengths``)."""
        batch_size = len(row_splits) - 1
        if self.max_batch is not None and batch_size > self.max_batch:
            raise ValueError(f"sharded inference: batch {j} has {batch_size} samples (feature "
                             f"'{spec.name}'), more than the {self.max_batch} the exchange's "
                             f"capacity was sized for (capacity_bytes({self.max_batch}))")

    def _flatten(self, lookup, spec, batch):
        """(ids int64[n], row_splits int64[B+1], owned bool[n]) of one feature."""
        id_bits = None
        if lookup.key_mode == "packed" and not lookup.group.is_static:
            id_bits = hashing.default_id_bits(len(lookup.table_names))
        if spec.name not in batch:
            raise ValueError(f"sharded inference: the batch lacks feature '{spec.name}'")
        value = batch[spec.name]
        if spec.is_sequence:
            _check_sequence_lengths(spec, value)
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
        keys, init_keys = lookup.store.storage_keys(ids, tables)
        rows = lookup.store.lookup_rows(tf.constant(keys), tf.constant(init_keys)).numpy()
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
        received = self._exchange().finish(j)
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
        # float32 sums, then the pooling of the one-host path (ServingGroup)
        return finish_pooling(total.astype(np.float32), count.astype(np.float32), spec.combiner)

    def _dense_part(self, features, embeddings):
        """The model's dense part on the pushed ``embeddings`` (per group, per feature),
        given to its lookups through this pass's LookupContext; its layers are unchanged."""
        context = LookupContext(substitutes={
            name: _PushedEmbeddings(lookup, embs)
            for (name, lookup), embs in zip(self._embeddings.named, embeddings)})
        with self._embeddings.use_context(context):
            return self.model(features, training=False)


def _is_plain(value):
    """A dense 1-D tensor or array of integer IDs (one per sample)."""
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    return (isinstance(value, (tf.Tensor, np.ndarray)) and shape is not None and
            len(shape) == 1 and np.dtype(getattr(dtype, "as_numpy_dtype", dtype)).kind in "iu")


def _rows(value, lo, hi):
    """Samples [lo, hi) of one input (dense tensors sliced in numpy: cheaper per batch
    than an eager slice op; a SparseTensor keeps its width L)."""
    if isinstance(value, (tf.Tensor, np.ndarray)):
        return np.asarray(value)[lo:hi]
    if isinstance(value, tf.SparseTensor):
        width = tf.shape(value, out_type=tf.int64)[1:]
        return tf.sparse.slice(value, tf.concat([[lo], tf.zeros_like(width)], 0),
                               tf.concat([[hi - lo], width], 0))
    return value[lo:hi]


def _check_sequence_lengths(spec, value):
    """Raises ValueError naming the feature, the sample, its length and ``max_len`` when
    a sequence is longer than ``max_len``, which sizes the exchange's slots. Runs before
    flattening (whose own check names neither the length nor the sample)."""
    if isinstance(value, tf.RaggedTensor):
        lengths = value.row_lengths().numpy()
    elif isinstance(value, tf.SparseTensor):
        rows = value.indices[:, 0].numpy() if value.indices.shape[0] else np.zeros(0, np.int64)
        lengths = np.bincount(rows)
    else:
        shape = tuple(value.shape) if hasattr(value, "shape") else np.shape(value)
        if len(shape) != 2:  # [B]: one ID per sample; other ranks: flattening raises
            return
        lengths = np.full(int(shape[0]), int(shape[1]))
    if len(lengths) and lengths.max() > spec.max_len:
        longest = int(np.argmax(lengths))
        raise ValueError(f"sharded inference: feature '{spec.name}': sample {longest} has a "
                         f"sequence of {int(lengths[longest])} IDs, longer than its "
                         f"max_len={spec.max_len} (the limit that sizes the exchange's "
                         "slots); truncate it in the input pipeline or raise max_len")


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
