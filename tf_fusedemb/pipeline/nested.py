"""NestedPipeline: the fused training step with NestPipe's nested pipelining (dual-buffer
prefetch across batches, frozen-window micro-batches inside a batch) and EmbRace's
vertical sparse scheduling, computing exactly what the synchronous ``tf_fusedemb.training.train_step`` does: it IS
that step (``tf_fusedemb.training.step.run_step``), run by a plan whose stages are this
pipeline's.

One ``tf.function`` per step t holds, as independent dataflow that TensorFlow's executor
runs concurrently (Horovod collectives are asynchronous kernels):

* the key routing of batch t+1 (DBP stage 3), once micro-batch 0's forward is done (its
  key AlltoAlls then queue behind t's row AlltoAlls); after t's local backward, the
  delayed row updates of batch t-1 (vertical scheduling), then the retrieval of t+1's rows into the
  prefetch buffer (stage 4), overlapping t's gradient and dense collectives;
* per micro-batch i of batch t: the rows AlltoAll, dense forward/backward, the gradient
  AlltoAll (FWP: one micro-batch's AlltoAlls overlap another's compute; the micro-batches'
  dense compute runs in order, see ``tf_fusedemb.training.step``);
* after the last micro-batch: per group, coalesced row gradients split into prior rows
  K(B_t) ∩ K(B_t+1), applied now, and delayed rows, applied in step t+1; the updated
  prior rows overwrite the prefetch buffer's copies (DBP's dual-buffer synchronisation),
  so batch t+1 sees exactly W_t+1 (Proposition 1);
* the dense AllReduce in EmbRace's priority order across steps: the top layers' half
  during t's backward, the bottom layers' half (the first layer, the step's largest
  gradient, finished last by the backward and needed first by the next forward) at the
  start of step t+1, so it is in flight while t+1's rows are exchanged and pooled; the
  update of θ_t is applied once, before t+1's dense forward reads the variables.

Why it is exact: the forward of t reads rows of K(B_t) only, all of which were written
(or synchronised) by step t-1; the delayed rows K(B_t-1) \\ K(B_t) are written before
t+1's retrieval reads the table; each group's optimizer step counter advances once per
batch and the delayed part reuses that batch's step (EmbRace's Adam fix); gradients are
summed over all micro-batches before one update (Proposition 2); the dense update of
step t is applied before any read of the dense variables in step t+1 (``tf.function``
orders a variable's assignments and reads in program order), once per step, so the
optimizer's step count is the synchronous one.

Table ops on one resource are ordered by ``tf.function``'s automatic control
dependencies in program order, so the step emits them in the order the schedule needs:
delayed writes of t-1, retrieval of t+1, updates of t.
"""
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

import tensorflow as tf
import tf_keras

from tf_fusedemb.comm import Communicator
from tf_fusedemb.layers.group_interface import StoredGroup
from tf_fusedemb.layers.group_store import GroupStore
from tf_fusedemb.layers.model_embeddings import ModelEmbeddings
from tf_fusedemb.layers.routed_lookup import RoutedLookup
from tf_fusedemb.ops.row_masks import masked_rows
from tf_fusedemb.pipeline.options import PipelineOptions
from tf_fusedemb.training import keysets
from tf_fusedemb.training.loop import TrainLoop
from tf_fusedemb.training.micro_batches import micro_batch_parts, rows_of, slice_rows
from tf_fusedemb.training.loss import LossLike
from tf_fusedemb.training.step import DENSE_GRADS, as_keras_loss, run_step, top_layers_split
from tf_fusedemb.training.step_variables import create_step_variables, step_variables_first
from tf_fusedemb.training.step_plan import (DensePending, PendingUpdate, Prepared, StepCarry,
                                            StepPlan, StepResult)
from tf_fusedemb.training.tracing import RankInvariantFunction


def refuse_policies_when_looking_ahead(stores: Iterable[GroupStore], who: str,
                                       fix: str) -> None:
    """Raises ValueError naming the groups of ``stores`` with an admission or eviction
    policy: a schedule that looks one batch ahead routes (and counts) batch t+1 before
    batch t's update, and its delayed updates could rewrite evicted rows, which is not the
    synchronous semantics. ``who`` and ``fix`` go into the message."""
    named = [g.group.name for g in stores if g.has_policy]
    if named:
        raise ValueError(f"{who}: admission/eviction policies need the synchronous step; "
                         f"{fix} (groups {named})")


class NestedPipeline:
    """Trains a model with FusedEmbedding layers under :class:`PipelineOptions`.

    Args:
      model: a Keras model whose FusedEmbedding layers receive ``x[feature name]``
        unchanged (prefetch routes those inputs ahead of the forward pass; a model that
        transforms them fails with an error saying so).
      loss: the loss, in any form ``compile(loss=...)`` accepts (a name, function,
        ``tf_keras.losses.Loss`` or a ``tf_fusedemb.training.KerasLoss``).
      optimizer: Keras optimizer of the dense variables.
      options: PipelineOptions (default: synchronous).
      communicator: default the model's layers'.
      embeddings: the model's ``ModelEmbeddings`` (default: found in ``model``).

    Use :meth:`run` over an iterable of ``(x, y)`` batches, drive it with a
    ``tf_fusedemb.training.loop.TrainLoop`` (which owns the data iterator and looks one batch
    ahead), or call :meth:`step` with the next batch's features, then :meth:`flush` before
    reading tables (checkpoint, eval, export): with vertical scheduling the last step's
    delayed rows are pending.

    It is the :class:`~tf_fusedemb.training.step_plan.PrefetchStages` of its
    :class:`~tf_fusedemb.training.step_plan.StepPlan` (``route``, ``route_slice``,
    ``retrieve``, ``apply_pending``, ``apply_prior``), which the planned step
    (``tf_fusedemb.training.step.run_step``) calls inside the traced step; each step takes
    the previous one's prefetched rows and delayed updates (``StepCarry``) and returns the
    next ones (``StepOutput``).
    """

    def __init__(self, model: tf_keras.Model, loss: LossLike,
                 optimizer: tf_keras.optimizers.Optimizer,
                 options: Optional[PipelineOptions] = None,
                 communicator: Optional[Communicator] = None,
                 embeddings: Optional[ModelEmbeddings] = None):
        self.model, self.optimizer = model, optimizer
        self.loss = as_keras_loss(loss, model)
        self.options = options or PipelineOptions()
        if self.options.is_measured:
            raise ValueError(f"NestedPipeline runs one schedule; {self.options.label!r} leaves a "
                             "choice to measurement: use tf_fusedemb.pipeline.make_pipeline "
                             "(an AutoPipeline)")
        self.embeddings = embeddings or ModelEmbeddings.of(model, communicator)
        self.comm = self.embeddings.communicator
        self.layers = self.embeddings.layers
        if not self.layers:
            raise ValueError("NestedPipeline: the model has no FusedEmbedding layer")
        self.lookups = self.embeddings.lookups
        # How every step runs, fixed before the first trace (the carry changes per step).
        self.plan = StepPlan(self.options.num_micro_batches, self.options.exchange, stages=self)
        # Where each layer finds its features in x (by layer name: names are unique).
        self._sources = {layer.name: feature_sources(model, layer) for layer in self.layers}
        if self.options.prefetch:
            refuse_policies_when_looking_ahead(
                self.embeddings.stores, "NestedPipeline", "prefetch (dbp) cannot be combined with them")
        self._prepared = None  # prefetch buffer of the next step
        self._pending = None  # delayed row updates of the last step
        self._dense_pending = None  # the last step's dense gradients, not yet applied
        # The step's variables (model, replicas, optimizer) before each trace: a deferred
        # dense update is applied in a later trace, where TensorFlow forbids creating them.
        self._step_fn = RankInvariantFunction(
            self._step, before_trace=step_variables_first(model, optimizer))
        self._prefetch_fn = RankInvariantFunction(self._prefetch)
        self._flush_fn = RankInvariantFunction(self._flush)

    # ------------------------------------------------------------------ public API
    def step(self, x: Mapping[str, tf.Tensor], y: Any, next_x: Optional[Mapping[str, tf.Tensor]] = None,
             sample_weight: Any = None) -> StepResult:
        """One training step on this rank's batch ``(x, y, sample_weight)``.

        Args:
          x, y, sample_weight: this rank's slice of the global batch.
          next_x: with prefetch, the next batch's features (None at the last step);
            they are routed and retrieved during this step. The next call must pass
            the same features as its ``x``.
        Returns:
          a :class:`~tf_fusedemb.training.StepResult` (global loss, its weight in
          Keras's running mean, this rank's predictions).
        """
        if not self.options.prefetch:
            result, _, _, _ = self._step_fn(x, y, sample_weight, None, None, None, None, None)
            return result
        if self._prepared is None:
            self._prepared = self._prefetch_fn(x)
        pending = self._pending if self._pending is not None else self._empty_pending()
        # No dense update left before the first step (or after a flush): zeros that the
        # step skips, so the first step runs the trace of every step after it.
        has_dense = self._dense_pending is not None
        dense = self._dense_pending if has_dense else self._no_dense_pending(x)
        # The last step prefetches an empty batch rather than none: it runs the trace of
        # every step before it (a step without a next batch is a second trace, half a
        # second at the end of the main job). Every key is then delayed, and flush()
        # applies the rows with this step's optimizer step, as it applies any delayed row.
        ahead = next_x if next_x is not None else slice_rows(x, 0, 0)
        result, prepared, self._pending, self._dense_pending = self._step_fn(
            x, y, sample_weight, self._prepared, pending, ahead, dense, tf.constant(has_dense))
        self._prepared = prepared if next_x is not None else None
        return result

    def flush(self) -> None:
        """Applies pending delayed row updates and the last step's dense update (call
        before reading or saving tables or weights; every rank must call it: the dense
        update's AllReduce is a collective)."""
        if self._pending is not None or self._dense_pending is not None:
            self._flush_fn(self._pending, self._dense_pending)
            self._pending = self._dense_pending = None

    def run(self, batches: Iterable, steps: Optional[int] = None) -> Iterator[Tuple[Any, Any]]:
        """Trains on ``(x, y)`` (or ``(x, y, sample_weight)``) batches, at most ``steps``,
        through a ``TrainLoop`` (one batch ahead for the prefetch); yields ``(loss,
        predictions)`` per step and flushes after the last."""
        for done in TrainLoop(self).run(batches, steps):
            yield done.result.loss, done.result.predictions

    def prefetch(self, x: Mapping[str, tf.Tensor]) -> Prepared:
        """DBP stages 3 and 4 of one batch alone (traced): per micro-batch, per lookup,
        the RoutedLookup with its retrieved ``rows``, as a step prefetches them for the
        next batch (the benchmarks time it)."""
        return self._prefetch_fn(x)

    # ------------------------------------------------------------------ traced parts
    def _empty_pending(self) -> List[PendingUpdate]:
        return [PendingUpdate(tf.zeros([0], tf.int64), tf.zeros([0, g.group.dim]),
                              tf.zeros([0], tf.int64), tf.constant(0, tf.int64))
                for g in self.lookups]

    def _no_dense_pending(self, x: Mapping[str, tf.Tensor]) -> Optional[DensePending]:
        """A DensePending of zeros shaped as a step leaves one (None for a model without
        dense variables, whose steps leave none)."""
        create_step_variables(self.model, self.optimizer, x)  # the variables to shape it
        variables = self.model.trainable_variables
        if not variables:
            return None
        zeros = [tf.zeros(v.shape, v.dtype) for v in variables]
        split = top_layers_split(variables)
        return DensePending(zeros[:split], zeros[split:])

    def apply_pending(self, pending: Sequence[PendingUpdate]) -> list:
        """Applies a step's delayed row updates (one per lookup), in the traced step."""
        return [g.store.apply_gradients(p.keys, p.grads, p.init_keys, step=p.step)
                for g, p in zip(self.lookups, pending)]

    def _flush(self, pending, dense_pending):
        if pending is not None:
            self.apply_pending(pending)  # ops run as the function's stateful ops
        if dense_pending is not None:
            self._apply_dense(dense_pending)

    def _apply_dense(self, dense_pending):
        """The previous step's dense update: its bottom layers' gradients summed over
        ranks now, with the top layers' (summed during that step), applied once."""
        bottom = list(self.comm.allreduce_sum_list(dense_pending.bottom, DENSE_GRADS))
        self.optimizer.apply_gradients(zip(bottom + list(dense_pending.top),
                                           self.model.trainable_variables))

    def route(self, x: Mapping[str, tf.Tensor]) -> Prepared:
        """Per micro-batch, per lookup: the RoutedLookup of ``x``'s slice, no rows yet
        (DBP stage 3)."""
        first = self.layers[0]
        parts = micro_batch_parts(
            (x,), self.options.num_micro_batches,
            lambda: rows_of(_feature(x, first.features[0].name, first, self._sources)))
        return [self.route_slice(x_i, i) for i, (x_i,) in enumerate(parts)]

    def route_slice(self, x: Mapping[str, tf.Tensor], i: int) -> List[RoutedLookup]:
        """Per lookup, the RoutedLookup of micro-batch ``i``, whose inputs are ``x``."""
        context = self.plan.context(i)
        return [r for layer in self.layers
                for r in layer.route({f.name: _feature(x, f.name, layer, self._sources)
                                      for f in layer.features}, context)]

    def retrieve(self, routed: Prepared) -> Prepared:
        """Rows of every routed lookup from the tables (DBP stage 4). A group with an SSD
        tier first pins the batch's keys in DRAM (one prefetch per batch, all its
        micro-batches), so neither this retrieval nor the batch's updates wait on disk."""
        pins = [g.store.prefetch(tf.concat([mb[j].keys for mb in routed], 0))
                for j, g in enumerate(self.lookups) if g.store.tiered]
        with tf.control_dependencies([p for p in pins if p is not None]):
            return [[r.with_rows(g.retrieve(r)) for g, r in zip(self.lookups, mb)]
                    for mb in routed]

    def _prefetch(self, x):
        return self.retrieve(self.route(x))

    def _step(self, x, y, sample_weight, prepared, pending, next_x, dense_pending, has_dense):
        if dense_pending is not None:  # before this step reads the dense variables
            def apply() -> tf.Tensor:
                # The update's tensors taken into the branch's graph: the optimizer's
                # gradient aggregation needs them all in one graph with the AllReduce's.
                self._apply_dense(tf.nest.map_structure(tf.identity, dense_pending))
                return tf.constant(True)
            tf.cond(has_dense, apply, lambda: tf.constant(False))
        carry = StepCarry(prepared, pending or (), next_x)
        out = run_step(self.model, x, y, self.loss, self.optimizer, sample_weight, self.plan,
                       carry, self.embeddings)
        return out.result, out.next_prepared, (out.pending or None), out.dense_pending

    def apply_prior(self, store: StoredGroup, keys: tf.Tensor, grads: tf.Tensor,
                    init_keys: tf.Tensor, next_rows: Sequence[RoutedLookup]
                    ) -> Tuple[PendingUpdate, List[tf.Tensor]]:
        """One group's coalesced update of step t (``keys`` int64[u], ``grads``
        float32[u, dim], ``init_keys`` int64[u]): the prior rows K(B_t) ∩ K(B_t+1) are
        updated now (all of them without vertical scheduling) and their fresh values
        overwrite the prefetch buffer's copies in ``next_rows`` (t+1's lookups, one per
        micro-batch); returns (the delayed rest, for step t+1; t+1's rows per
        micro-batch). The delayed part reuses step t's optimizer step (EmbRace's Adam fix)."""
        next_keys = tf.concat([p.keys for p in next_rows], 0)
        step = store.advance_step()
        if self.options.uses_vertical:
            prior, _ = keysets.find_keys(keys, next_keys)
        else:
            prior = tf.ones_like(keys, tf.bool)
        delayed = tf.logical_not(prior)
        dk, dg, di = masked_rows(delayed, keys, grads, init_keys)
        pending = PendingUpdate(dk, dg, di, step)
        pk, pg, pi = masked_rows(prior, keys, grads, init_keys)
        if not self.options.sync_buffers:  # the stale variant: t+1 keeps pre-update rows
            with tf.control_dependencies([p.rows for p in next_rows]):
                store.apply_gradients(pk, pg, pi, step=step)
            return pending, [p.rows for p in next_rows]
        _, new_rows = store.apply_gradients(pk, pg, pi, step=step, return_rows=True)
        padded = tf.concat([new_rows, tf.zeros([1, store.group.dim])], 0)
        rows = []
        for p in next_rows:  # dual-buffer synchronisation: fresh values of K(B_t) ∩ K(B_t+1)
            found, index = keysets.find_keys(p.keys, pk)
            index = tf.where(found, index, tf.size(pk))
            rows.append(tf.where(found[:, None], tf.gather(padded, index), p.rows))
        return pending, rows


def feature_sources(model: Any, layer: Any) -> Dict[str, Any]:
    """{feature: the key of the model's input ``x`` that holds it}: in a functional model
    whose FusedEmbedding is called on model inputs directly, the input each feature's
    tensor is (``fuse_model`` names features after the Embedding layers, not after the
    inputs); else the feature's own name (x holds the features by name)."""
    sources = {f.name: f.name for f in layer.features}
    nodes = getattr(layer, "_inbound_nodes", None) or []
    model_inputs = getattr(model, "_nested_inputs", None)
    if len(nodes) != 1 or not isinstance(model_inputs, dict):
        return sources
    args = nodes[0].call_args
    feeds = args[0] if args else None
    if not isinstance(feeds, dict):
        return sources
    keys = {id(tensor): key for key, tensor in model_inputs.items()}
    for feature, tensor in feeds.items():
        if id(tensor) in keys:
            sources[feature] = keys[id(tensor)]
    return sources


def _feature(x, name, layer, sources):
    key = sources[layer.name][name]
    if not isinstance(x, dict) or key not in x:
        raise ValueError(f"NestedPipeline: prefetch and micro-batches need x to be a dict "
                         f"holding each FusedEmbedding feature (feature '{name}' of layer "
                         f"'{layer.name}' as x[{key!r}]); it is missing. They read the IDs "
                         "from x, so the layer must take its inputs from x directly")
    return x[key]

