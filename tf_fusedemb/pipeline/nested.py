"""NestedPipeline: the fused training step with NestPipe's nested pipelining (dual-buffer
prefetch across batches, frozen-window micro-batches inside a batch) and EmbRace's
vertical sparse scheduling, computing exactly what ``tf_fusedemb.training.train_step`` does.

One ``tf.function`` per step t holds, as independent dataflow that TensorFlow's executor
runs concurrently (Horovod collectives are asynchronous kernels):

* the key routing of batch t+1 (DBP stage 3); after t's local backward, the delayed row
  updates of batch t-1 (vertical scheduling), then the retrieval of t+1's rows into the
  prefetch buffer (stage 4), overlapping t's gradient and dense collectives;
* per micro-batch i of batch t: the rows AlltoAll, dense forward/backward, the gradient
  AlltoAll (FWP: one micro-batch's AlltoAlls overlap another's compute);
* after the last micro-batch: dense AllReduce and update; per group, coalesced row
  gradients split into prior rows K(B_t) ∩ K(B_t+1), applied now, and delayed rows,
  applied in step t+1; the updated prior rows overwrite the prefetch buffer's copies
  (DBP's dual-buffer synchronisation), so batch t+1 sees exactly W_t+1 (Proposition 1).

Why it is exact: the forward of t reads rows of K(B_t) only, all of which were written
(or synchronised) by step t-1; the delayed rows K(B_t-1) \\ K(B_t) are written before
t+1's retrieval reads the table; each group's optimizer step counter advances once per
batch and the delayed part reuses that batch's step (EmbRace's Adam fix); gradients are
summed over all micro-batches before one update (Proposition 2).

Table ops on one resource are ordered by ``tf.function``'s automatic control
dependencies in program order, so the step emits them in the order the schedule needs:
delayed writes of t-1, retrieval of t+1, updates of t.
"""
from typing import Iterable, Optional

import tensorflow as tf

from tf_fusedemb.comm import get_communicator
from tf_fusedemb.layers.fused_embedding import fused_embedding_layers
from tf_fusedemb.layers.recording import dense_gradient, record_lookups, row_gradient
from tf_fusedemb.layers.staging import staged_lookups
from tf_fusedemb.pipeline import keysets
from tf_fusedemb.pipeline.micro_batches import batch_size_of, micro_batch_slices, slice_rows
from tf_fusedemb.pipeline.options import PipelineOptions
from tf_fusedemb.training.step import DENSE_GRADS, LOSS_STATS, as_keras_loss, regularization
from tf_fusedemb.training.tracing import RankInvariantFunction


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
      communicator: default ``tf_fusedemb.comm.get_communicator()``.

    Use :meth:`run` over an iterable of ``(x, y)`` batches, or :meth:`step` with the next
    batch's features, then :meth:`flush` before reading tables (checkpoint, eval,
    export): with vertical scheduling the last step's delayed rows are pending.
    """

    def __init__(self, model, loss, optimizer, options: Optional[PipelineOptions] = None,
                 communicator=None):
        self.model, self.optimizer = model, optimizer
        self.loss = as_keras_loss(loss, model)
        self.options = options or PipelineOptions()
        self.comm = communicator or get_communicator()
        self.layers = fused_embedding_layers(model)
        if not self.layers:
            raise ValueError("NestedPipeline: the model has no FusedEmbedding layer")
        self.lookups = [g for layer in self.layers for g in layer.groups]
        self._prepared = None  # prefetch buffer of the next step
        self._pending = None  # delayed row updates of the last step
        self._step_fn = RankInvariantFunction(self._step)
        self._prefetch_fn = RankInvariantFunction(self._prefetch)
        self._flush_fn = RankInvariantFunction(self._flush)

    # ------------------------------------------------------------------ public API
    def step(self, x, y, next_x=None):
        """One training step on this rank's batch ``(x, y)``.

        Args:
          x, y: this rank's slice of the global batch.
          next_x: with prefetch, the next batch's features (None at the last step);
            they are routed and retrieved during this step. The next call must pass
            the same features as its ``x``.
        Returns:
          (global mean loss float32 scalar, this rank's predictions).
        """
        if not self.options.prefetch:
            loss, pred, _, _ = self._step_fn(x, y, None, None, None)
            return loss, pred
        if self._prepared is None:
            self._prepared = self._prefetch_fn(x)
        pending = self._pending if self._pending is not None else self._empty_pending()
        loss, pred, prepared, self._pending = self._step_fn(x, y, self._prepared, pending,
                                                            next_x)
        self._prepared = prepared if next_x is not None else None
        return loss, pred

    def flush(self):
        """Applies pending delayed row updates (call before reading or saving tables)."""
        if self._pending is not None:
            self._flush_fn(self._pending)
            self._pending = None

    def run(self, batches: Iterable, steps: Optional[int] = None):
        """Trains on ``(x, y)`` batches (at most ``steps``), looking one batch ahead for
        the prefetch; yields ``(loss, predictions)`` per step and flushes at the end."""
        iterator = iter(batches)
        current = next(iterator, None)
        done = 0
        while current is not None and (steps is None or done < steps):
            last = steps is not None and done + 1 >= steps
            upcoming = None if last else next(iterator, None)
            x, y = current[0], current[1]
            yield self.step(x, y, None if upcoming is None else upcoming[0])
            current, done = upcoming, done + 1
        self.flush()

    # ------------------------------------------------------------------ traced parts
    def _empty_pending(self):
        return [{"keys": tf.zeros([0], tf.int64), "grads": tf.zeros([0, g.group.dim]),
                 "init_keys": tf.zeros([0], tf.int64), "step": tf.constant(0, tf.int64)}
                for g in self.lookups]

    def _apply_pending(self, pending):
        return [g.table.apply_gradients(p["keys"], p["grads"], p["init_keys"], step=p["step"])
                for g, p in zip(self.lookups, pending)]

    def _flush(self, pending):
        self._apply_pending(pending)  # ops run as the function's stateful ops

    def _route(self, x):
        """Per micro-batch, per lookup: the route() dict of ``x``'s slice (DBP stage 3)."""
        routed = []
        bounds = micro_batch_slices(_features_batch_size(x, self.layers),
                                    self.options.micro_batches)
        for i, (lo, hi) in enumerate(bounds):
            xi = slice_rows(x, lo, hi)
            with staged_lookups(None, self._suffix(i)):
                routed.append([r for layer in self.layers
                               for r in layer.route({f.name: _feature(xi, f.name, layer)
                                                     for f in layer.features})])
        return routed

    def _retrieve(self, routed):
        """Rows of every routed lookup from the tables (DBP stage 4)."""
        return [[dict(r, rows=g.retrieve(r)) for g, r in zip(self.lookups, mb)] for mb in routed]

    def _prefetch(self, x):
        return self._retrieve(self._route(x))

    def _suffix(self, i):
        return f"/mb{i}" if self.options.micro_batches > 1 else ""

    def _step(self, x, y, prepared, pending, next_x):
        opts, comm = self.options, self.comm
        # DBP stage 3: t+1's key routing starts at once (its AlltoAll is small).
        routed_next = self._route(next_x) if next_x is not None else None
        local_n = batch_size_of(y)
        # FWP: every micro-batch's forward first, then the backwards, so each one's
        # collectives can be in flight while another computes.
        tapes, partials, preds, all_records = [], [], [], []
        reg = None
        for i, (lo, hi) in enumerate(micro_batch_slices(local_n, opts.micro_batches)):
            staged = None if prepared is None else {
                id(g): p for g, p in zip(self.lookups, prepared[i])}
            with staged_lookups(staged, self._suffix(i)), \
                    tf.GradientTape() as tape, record_lookups(tape) as records:
                pred = self.model(slice_rows(x, lo, hi), training=True)
                partials.append(self.loss.partial(slice_rows(y, lo, hi), pred))
                if i == 0:  # weight regularisers: once per batch, as in Keras
                    reg = regularization(self.model)
            tapes.append(tape)
            preds.append(pred)
            all_records.append(records)
        summed = tf.add_n([p.stacked() for p in partials])
        totals = self.loss.combine(partials[0], comm.allreduce_sum(summed, LOSS_STATS), reg)
        dense_vars = list(self.model.trainable_variables)  # built by the first forward
        dense_sum = [tf.zeros_like(v) for v in dense_vars]
        parts = {id(g.table): [] for g in self.lookups}
        for i, (tape, part, records) in enumerate(zip(tapes, partials, all_records)):
            targets, scales = list(part.sums), list(totals.coefficients)
            if i == 0 and reg is not None:
                targets.append(reg)
                scales.append(totals.regularization / comm.size)
            grads = tape.gradient(targets, dense_vars + [r.rows for r in records],
                                  output_gradients=scales)
            dense_sum = [a + dense_gradient(g, v) for a, g, v in zip(dense_sum, grads, dense_vars)]
            for r, g in zip(records, grads[len(dense_vars):]):
                parts[id(r.table)].append((r.keys, row_gradient(g, r.rows), r.init_keys))
        # t-1's delayed rows, then DBP stage 4 (retrieval of t+1's rows, which must see
        # those writes), once t's local backward is computed: on shared cores they then
        # fill the time t's gradient and dense collectives are in flight instead of
        # competing with t's forward.
        with tf.control_dependencies(dense_sum or [totals.value]):
            delayed = self._apply_pending(pending) if pending is not None else []
        nxt = None
        if routed_next is not None:
            with tf.control_dependencies([d for d in delayed if d is not None] + [totals.value]):
                nxt = self._retrieve(routed_next)
        if dense_vars:
            dense = comm.allreduce_sum_list(dense_sum, DENSE_GRADS)
            self.optimizer.apply_gradients(zip(dense, dense_vars))
        updates, new_pending, synced = [], [], [[] for _ in range(len(nxt or []))]
        for j, g in enumerate(self.lookups):
            keys, grads, init = _coalesce(parts[id(g.table)], g.group.dim)
            if nxt is None:
                updates.append(g.table.apply_gradients(keys, grads, init))
                continue
            nxt_j = [mb[j] for mb in nxt]
            up, pend, rows = self._apply_prior(g, keys, grads, init, nxt_j)
            updates.append(up)
            new_pending.append(pend)
            for i, r in enumerate(rows):
                synced[i].append(dict(nxt_j[i], rows=r))
        pred = tf.concat(preds, 0) if len(preds) > 1 else preds[0]
        return totals.value, pred, synced, (new_pending or None)

    def _apply_prior(self, g, keys, grads, init, nxt_j):
        """Updates prior rows of one group now and returns (op, pending delayed part,
        synchronised prefetch rows per micro-batch of t+1)."""
        next_keys = tf.concat([p["keys"] for p in nxt_j], 0)
        step = g.table.advance_step()
        if self.options.uses_vertical:
            prior, _ = keysets.find_keys(keys, next_keys)
        else:
            prior = tf.ones_like(keys, tf.bool)
        delayed = tf.logical_not(prior)
        pending = {"keys": tf.boolean_mask(keys, delayed), "grads": tf.boolean_mask(grads, delayed),
                   "init_keys": tf.boolean_mask(init, delayed), "step": step}
        pk, pg, pi = (tf.boolean_mask(t, prior) for t in (keys, grads, init))
        if not self.options.sync_buffers:  # the stale variant: t+1 keeps pre-update rows
            with tf.control_dependencies([p["rows"] for p in nxt_j]):
                op = g.table.apply_gradients(pk, pg, pi, step=step)
            return op, pending, [p["rows"] for p in nxt_j]
        op, new_rows = g.table.apply_gradients(pk, pg, pi, step=step, return_rows=True)
        padded = tf.concat([new_rows, tf.zeros([1, g.group.dim])], 0)
        rows = []
        for p in nxt_j:  # dual-buffer synchronisation: fresh values of K(B_t) ∩ K(B_t+1)
            found, index = keysets.find_keys(p["keys"], pk)
            index = tf.where(found, index, tf.size(pk))
            rows.append(tf.where(found[:, None], tf.gather(padded, index), p["rows"]))
        return op, pending, rows


def _coalesce(parts, dim):
    """One (keys, grads, init_keys) per group from its micro-batches' records."""
    if not parts:  # the group's layer was not called: an empty update
        return tf.zeros([0], tf.int64), tf.zeros([0, dim]), tf.zeros([0], tf.int64)
    if len(parts) == 1:  # keys are unique already (the owner's lookup keys)
        return parts[0]
    return keysets.coalesce(*(tf.concat(list(c), 0) for c in zip(*parts)))


def _feature(x, name, layer):
    if not isinstance(x, dict) or name not in x:
        raise ValueError(f"NestedPipeline: prefetch needs x to be a dict holding each "
                         f"FusedEmbedding feature by name; feature '{name}' of layer "
                         f"'{layer.name}' is missing")
    return x[name]


def _features_batch_size(x, layers):
    value = _feature(x, layers[0].features[0].name, layers[0])
    if isinstance(value, tf.RaggedTensor):
        return value.nrows(out_type=tf.int64)
    if isinstance(value, tf.SparseTensor):
        return value.dense_shape[0]
    return tf.shape(value, out_type=tf.int64)[0]
