"""The one training step of a model with FusedEmbedding layers, and its evaluation step.

Correctness contract: with N ranks each holding a slice of the global batch, one step
computes exactly what ``tf_keras.Model.fit`` computes for the global batch in one process
(the loss of ``compile``, see :mod:`tf_fusedemb.training.loss`):

* each rank computes the additive pieces of its slice's loss (weighted sums, element
  counts, rows); one AllReduce sums them, so unequal or empty slices are exact too;
* each rank differentiates its own sums scaled by the global coefficients (plus 1/N of
  the regularisation losses, which every rank holds whole): the sum over ranks is the
  global gradient;
* dense gradients are summed over ranks (one grouped AllReduce: EmbRace's hybrid scheme);
* embedding-row gradients are summed over requesting ranks by the gradient AlltoAll and
  applied by each group's row optimizer to the touched rows on their owner.

A :class:`~tf_fusedemb.training.step_plan.StepPlan`, made before the step is traced,
decides only *when* parts of the step run (NestPipe Section VI): how many micro-batches
(FWP), which lookups were prepared ahead (DBP), what runs once the local backward is done,
and how the row updates are split (EmbRace). :func:`run_step` takes the plan and what the
step before left (``StepCarry``) and returns a ``StepOutput``; :func:`train_step` is the
synchronous plan's step, and ``tf_fusedemb.pipeline`` runs the pipelined ones.

With N > 1 micro-batches the step runs their dense compute one after another
(control dependencies, no value changes): micro-batch i+1's dense forward waits for i's
output, its backward for i's dense gradients. TensorFlow's executor would otherwise
interleave all N forwards and all N backwards, so every micro-batch's collectives
would become ready together at the end of each phase, with nothing left to overlap
them (seen in Horovod's timeline, docs/timelines/). A micro-batch's lookup starts once
the previous one's rows are retrieved, so its key and row AlltoAlls run while earlier
micro-batches compute, and micro-batch 0's rows come first.

The loss's sizes (element counts, rows) are summed over ranks at the step's start (they
depend on the labels only), so the backward never waits for a collective; the loss sums,
only needed for the reported value, travel with the dense gradients.
"""
import dataclasses
from typing import Any, Collection, List, NamedTuple, Optional, Sequence, Tuple

import tensorflow as tf
import tf_keras

from tf_fusedemb.comm import Communicator
from tf_fusedemb.layers.group_interface import DistributedGroupLookup
from tf_fusedemb.layers.keys_ahead import (KeysAhead, keys_ahead, route_ahead, serve_ahead,
                                           shared_tables)
from tf_fusedemb.layers.model_embeddings import ModelEmbeddings
from tf_fusedemb.layers.routed_lookup import RoutedLookup
from tf_fusedemb.layers.row_update import row_gradient
from tf_fusedemb.training import keysets
from tf_fusedemb.training.loss import KerasLoss, LossLike, LossPartial, LossTotals
from tf_fusedemb.training.micro_batches import batch_size_of, micro_batch_parts
from tf_fusedemb.training.replicas import build_by_tracing, replicas_of
from tf_fusedemb.training.step_plan import (DensePending, PendingUpdate, Prepared, StepCarry,
                                            StepOutput, StepPlan, StepResult)

LOSS_STATS = "fusedemb/loss_stats"
DENSE_GRADS = "fusedemb/dense_grads"


def update_dense(comm: Communicator, optimizer: tf_keras.optimizers.Optimizer,
                 grads: List[tf.Tensor], variables: List[tf.Variable],
                 row_grads: List[tf.Tensor], extras: List[tf.Tensor]) -> List[tf.Tensor]:
    """Sums this rank's dense ``grads`` (one per variable) over ranks and applies them
    with ``optimizer``; returns ``extras`` (other tensors to sum, e.g. the loss sums)
    summed over ranks. Two grouped AllReduces (EmbRace's dense AllReduce, split in time;
    the sums are the same):

    * the variables created last (a model's top layers, whose gradients the backward
      finishes first), up to half the elements (:func:`top_layers_split`): as soon as
      they are summed over the micro-batches, while the backward still runs;
    * the others and ``extras`` after ``row_grads`` (the received row gradients):
      Horovod runs one collective at a time, so the row AlltoAlls go first and the
      row updates compute while this AllReduce, the step's largest, is in flight.
    """
    split = top_layers_split(variables)
    top = comm.allreduce_sum_list(grads[split:], DENSE_GRADS + "/top") \
        if split < len(variables) else []
    late = list(comm.allreduce_sum_list(after(row_grads, grads[:split] + extras),
                                        DENSE_GRADS))
    optimizer.apply_gradients(zip(late[:split] + list(top), variables))
    return late[split:]


def defer_dense(comm: Communicator, grads: List[tf.Tensor], variables: List[tf.Variable],
                extras: List[tf.Tensor]) -> Tuple[List[tf.Tensor], DensePending]:
    """The dense update of a step whose next step applies it (EmbRace's priority order
    across steps): the top layers' half summed over ranks now, with ``extras``, during
    the backward; the bottom half (the first layer, the step's largest gradient) left to
    be summed at the start of the next step. Returns (``extras`` summed, the update left)."""
    split = top_layers_split(variables)
    reduced = list(comm.allreduce_sum_list(grads[split:] + extras, DENSE_GRADS + "/top"))
    top = len(variables) - split
    return reduced[top:], DensePending(grads[:split], reduced[:top])


def as_keras_loss(loss: LossLike, model: Optional[tf_keras.Model] = None) -> KerasLoss:
    """``loss`` as a :class:`KerasLoss` (a loss name, function, Loss object, or already one)."""
    if isinstance(loss, KerasLoss):
        return loss
    return KerasLoss(loss, output_names=getattr(model, "output_names", None))


def regularization(model: tf_keras.Model) -> Optional[tf.Tensor]:
    """Sum of the model's regularisation losses (``model.losses``), or None."""
    losses = model.losses
    return tf.add_n([tf.cast(l, tf.float32) for l in losses]) if losses else None


def loss_totals(loss: KerasLoss, partials: Sequence[LossPartial], reg: Optional[tf.Tensor],
                comm: Communicator) -> LossTotals:
    """Sums the slices' ``partials`` over micro-batches and ranks (one AllReduce) and
    combines them (see KerasLoss)."""
    summed = tf.add_n([p.stacked() for p in partials])
    return loss.combine(partials[0], comm.allreduce_sum(summed, LOSS_STATS), reg)


@tf.autograph.experimental.do_not_convert  # TensorFlow control flow already: see FusedEmbedding
def train_step(model: tf_keras.Model, x: Any, y: Any, loss: LossLike,
               optimizer: tf_keras.optimizers.Optimizer, sample_weight: Any = None,
               communicator: Optional[Communicator] = None,
               embeddings: Optional[ModelEmbeddings] = None) -> StepResult:
    """One synchronous training step on this rank's slice ``(x, y, sample_weight)``.

    Args:
      model: a Keras model containing FusedEmbedding layers.
      x, y, sample_weight: this rank's slice of the global batch (labels [B] or [B, 1]
        against outputs [B, 1] alike, as in Keras).
      loss: a :class:`KerasLoss`, or anything ``compile(loss=...)`` accepts.
      optimizer: the Keras optimizer of the dense variables.
      communicator: default the model's layers'.
      embeddings: the model's ``ModelEmbeddings`` (default: found in ``model``).
    """
    embeddings = embeddings or ModelEmbeddings.of(model, communicator)
    return run_step(model, x, y, loss, optimizer, sample_weight, StepPlan(), StepCarry(),
                    embeddings).result


@tf.autograph.experimental.do_not_convert
def run_step(model: tf_keras.Model, x: Any, y: Any, loss: LossLike,
             optimizer: tf_keras.optimizers.Optimizer, sample_weight: Any, plan: StepPlan,
             carry: StepCarry, embeddings: ModelEmbeddings) -> StepOutput:
    """One training step by ``plan`` (micro-batches, exchange, a pipeline's stages), with
    what the step before left (``carry``: prefetched rows, delayed updates, the next
    batch to prefetch); returns its result and what it leaves for the next step.

    The plan decides only *when* parts of the step run (NestPipe Section VI), never what
    is computed: every plan gives the synchronous step's losses and updates.
    """
    comm = embeddings.communicator
    loss = as_keras_loss(loss, model)
    # Rank 0's dense state on every rank before the first forward reads it (broadcast
    # eagerly while the first step is traced), and the replica guard.
    replicas = replicas_of(model)
    replicas.synchronize(comm, optimizer, x, training=True)
    # FWP: every micro-batch's forward first, then the backwards, so each one's
    # collectives can be in flight while another computes.
    lookups = embeddings.lookups
    forwards, reg, routed_next = _forwards(model, x, y, sample_weight, loss, plan, carry,
                                           embeddings)
    partials = [f.partial for f in forwards]
    # The loss's sizes (element counts, rows) depend on the labels only: summed over ranks
    # at the step's start, they give the backward its coefficients without waiting for
    # a collective between forward and backward. The sums (the reported value) travel
    # with the dense gradients at the end.
    sizes = comm.allreduce_sum(tf.add_n([p.stacked_sizes() for p in partials]), LOSS_STATS)
    scales = list(loss.coefficients(partials[0], sizes))
    reg_scale = loss.regularization_coefficient(partials[0], sizes) / comm.size
    dense_vars = list(model.trainable_variables)  # built by the first forward
    dense_sum, parts = _backwards(forwards, scales, reg, reg_scale, dense_vars, len(lookups))
    local_sums = tf.add_n([p.stacked_sums() for p in partials])
    next_rows = _after_backward(plan, carry, routed_next, dense_sum or [local_sums])
    dense_pending = None
    if dense_vars and next_rows is not None:
        (sums,), dense_pending = defer_dense(comm, dense_sum, dense_vars, [local_sums])
    elif dense_vars:
        row_grads = [g for group in parts for _, g, _ in group]
        sums, = update_dense(comm, optimizer, dense_sum, dense_vars, row_grads, [local_sums])
    else:
        sums = comm.allreduce_sum(local_sums, LOSS_STATS + "/sums")
    totals = loss.totals(partials[0], sizes, sums, reg)
    replicas.average_forward_state(comm)  # e.g. BatchNormalization's statistics
    next_prepared: Prepared = [[] for _ in next_rows] if next_rows is not None else []
    pending: List[PendingUpdate] = []
    if forwards[0].prepared:
        for j, lookup in enumerate(lookups):
            if forwards[0].prepared[j] is None:  # looked up during the forward pass
                continue
            keys, grads, init = _coalesce(parts[j], lookup.group.dim)
            if next_rows is None or plan.stages is None:
                lookup.store.apply_gradients(keys, grads, init)
                continue
            next_j = [mb[j] for mb in next_rows]
            delayed, rows = plan.stages.apply_prior(lookup.store, keys, grads, init, next_j)
            pending.append(delayed)
            for i, r in enumerate(rows):
                next_prepared[i].append(next_j[i].with_rows(r))
    preds = [f.predictions for f in forwards]
    pred = preds[0] if len(preds) == 1 else tf.nest.map_structure(
        lambda *p: tf.concat(p, 0), *preds)
    result = StepResult(totals.value, totals.weight, pred, tuple(totals.per_output))
    return StepOutput(result, next_prepared, pending, dense_pending)


def _after_backward(plan: StepPlan, carry: StepCarry, routed_next: Optional[Prepared],
                    done: List[tf.Tensor]) -> Optional[Prepared]:
    """Once this rank's local backward is computed (``done``): the previous step's
    delayed rows, then DBP stage 4 (the next batch's rows, which must see those writes).
    On shared cores they then fill the time the step's gradient and dense collectives are
    in flight instead of competing with its forward. Returns the next batch's retrieved
    lookups, None without a next batch."""
    if plan.stages is None:
        return None
    with tf.control_dependencies(done):
        delayed = plan.stages.apply_pending(carry.pending) if carry.pending else []
    if routed_next is None:
        return None
    with tf.control_dependencies([d for d in delayed if d is not None] + done):
        return plan.stages.retrieve(routed_next)


class MicroBatchForward(NamedTuple):
    """One micro-batch's forward pass: its ``tape``, loss ``partial``, model
    ``predictions`` and, per group lookup, the lookup its plan prepared or the
    step routed ahead (``keys_ahead``), whose rows the tape watches (None for a group
    looked up during the forward pass; empty when the forward pass routed them all)."""
    tape: tf.GradientTape
    partial: LossPartial
    predictions: Any
    prepared: List[Optional[RoutedLookup]]


def _forwards(model: tf_keras.Model, x: Any, y: Any, sample_weight: Any, loss: KerasLoss,
              plan: StepPlan, carry: StepCarry, embeddings: ModelEmbeddings
              ) -> Tuple[List[MicroBatchForward], Optional[tf.Tensor], Optional[Prepared]]:
    """Every micro-batch's forward pass, in order, the regularisation losses (of the
    first: once per batch, as in Keras) and the next batch's routed lookups (DBP stage 3,
    started once micro-batch 0's forward is built; None without a next batch)."""
    forwards: List[MicroBatchForward] = []
    reg: Optional[tf.Tensor] = None
    routed_next: Optional[Prepared] = None
    lookups = embeddings.lookups
    lookup_inputs = embeddings.feature_names
    parts = micro_batch_parts((x, y, sample_weight), plan.micro_batches,
                              lambda: batch_size_of(y))
    for i, (x_i, y_i, weight_i) in enumerate(parts):
        if forwards and isinstance(x_i, dict):  # x not a dict: which part feeds the lookups
            # is unknown. Dense compute after the previous micro-batch's; the lookups once
            # the previous micro-batch's rows are retrieved (its row AlltoAll then goes
            # while this one routes; all at once, they would share the core and micro-batch
            # 0's rows would come last of all).
            x_i = after(tf.nest.flatten(forwards[-1].predictions), x_i, skip=lookup_inputs)
            x_i = after([r.rows for r in forwards[-1].prepared if r is not None], x_i,
                        skip=[k for k in x_i if k not in lookup_inputs])
        mine: List[Optional[RoutedLookup]] = list(
            _prepared_lookups(plan, carry, i, x_i, lookups))
        context = plan.context(i)
        ahead = None if mine else _keys_ahead(model, embeddings, x_i)
        if ahead is not None:  # every table's keys first: one exchange per fused group
            mine = route_ahead(embeddings, ahead, context)
        with tf.GradientTape() as tape:
            watched = [r for r in mine if r is not None]
            for routed in watched:  # their gradient is this step's to apply (run_step)
                tape.watch(routed.rows)
            if ahead is not None:
                context = dataclasses.replace(context,
                                              served=serve_ahead(embeddings, ahead, mine,
                                                                 context))
            else:
                context = dataclasses.replace(context, prepared=tuple(zip(lookups, watched)))
            with embeddings.use_context(context):
                pred = model(x_i, training=True)
            partial = loss.partial(y_i, pred, weight_i)
            if i == 0:
                reg = regularization(model)
        if i == 0 and carry.next_x is not None and plan.stages is not None:
            # DBP stage 3: the next batch's key routing once micro-batch 0's forward is
            # built. Horovod runs collectives one at a time in the order all ranks
            # requested them: started at once, the next batch's key AlltoAlls would run
            # before this one's row AlltoAlls, which the forward waits for (seen in the
            # timeline, docs/timelines/).
            routed_next = plan.stages.route(after(tf.nest.flatten(pred), carry.next_x))
        forwards.append(MicroBatchForward(tape, partial, pred, mine))
    return forwards, reg, routed_next


def _keys_ahead(model: tf_keras.Model, embeddings: ModelEmbeddings, x: Any
                ) -> Optional[KeysAhead]:
    """``keys_ahead`` of a model built first (its variables are not made in the probe's
    scratch graph); None at once for a model whose layers share no tables."""
    tables = shared_tables(model, embeddings)
    if not tables:
        return None
    if not model.built:
        build_by_tracing(model, x)
    return keys_ahead(model, embeddings, x, tables)


def _backwards(forwards: Sequence[MicroBatchForward], scales: List[tf.Tensor],
               reg: Optional[tf.Tensor], reg_scale: tf.Tensor, dense_vars: List[tf.Variable],
               num_lookups: int):
    """Every micro-batch's backward, in order: (the dense gradients summed over the
    micro-batches, one per variable; per prepared lookup, its micro-batches' (keys int64[u],
    row gradients float32[u, dim], init keys int64[u]))."""
    dense_sum: List[tf.Tensor] = []  # the first micro-batch's gradients start the sums
    parts: List[List[Tuple[tf.Tensor, tf.Tensor, tf.Tensor]]] = [[] for _ in range(num_lookups)]
    previous: List[tf.Tensor] = []
    for i, f in enumerate(forwards):
        targets, coefficients = list(f.partial.sums), list(scales)
        if i == 0 and reg is not None:
            targets.append(reg)
            coefficients.append(reg_scale)
        # This micro-batch's backward after the previous one's dense gradients (FWP: its
        # gradient AlltoAll is in flight meanwhile).
        watched = [(j, r) for j, r in enumerate(f.prepared) if r is not None]
        with tf.control_dependencies(previous):
            grads = f.tape.gradient(targets, dense_vars + [r.rows for _, r in watched],
                                    output_gradients=coefficients)
        local = [dense_gradient(g, v) for g, v in zip(grads, dense_vars)]
        previous = local if len(forwards) > 1 else []
        dense_sum = [a + g for a, g in zip(dense_sum, local)] if dense_sum else local
        for (j, r), g in zip(watched, grads[len(dense_vars):]):
            parts[j].append((r.keys, row_gradient(g, r.rows), r.init_keys))
    return dense_sum, parts


def test_step(model: tf_keras.Model, x: Any, y: Any, loss: LossLike, sample_weight: Any = None,
              communicator: Optional[Communicator] = None,
              embeddings: Optional[ModelEmbeddings] = None) -> StepResult:
    """The loss of this rank's slice in the global batch, without training (Keras's
    ``evaluate``); the same collectives on every rank. ``communicator``: default the
    model's layers'; ``embeddings``: the model's ``ModelEmbeddings`` (default: found)."""
    comm = (embeddings or ModelEmbeddings.of(model, communicator)).communicator
    loss = as_keras_loss(loss, model)
    replicas_of(model).synchronize(comm, x=x)  # evaluating before any training step
    y_pred = model(x, training=False)
    totals = loss_totals(loss, [loss.partial(y, y_pred, sample_weight)], regularization(model),
                         comm)
    return StepResult(totals.value, totals.weight, y_pred, tuple(totals.per_output))


def top_layers_split(variables: Sequence[tf.Variable]) -> int:
    """Index splitting ``variables`` (a model's, in creation order) into the bottom ones
    and the top ones, created last, holding at most half the elements (at least one
    variable stays at the bottom)."""
    sizes = [v.shape.num_elements() or 0 for v in variables]
    split, top = len(sizes), 0
    while split > 1 and top + sizes[split - 1] <= sum(sizes) / 2:
        split -= 1
        top += sizes[split]
    return split


def dense_gradient(grad: Optional[tf.Tensor], var: tf.Variable) -> tf.Tensor:
    """A dense variable's gradient as a tensor; zeros for None, so every rank's
    collectives stay identical."""
    return tf.zeros_like(var) if grad is None else tf.convert_to_tensor(grad)


def after(deps: List[tf.Tensor], x: Any, skip: Collection[str] = ()) -> Any:
    """``x`` (a tensor, or a dict / list / tuple of them) whose plain tensors, except the
    dict entries named in ``skip``, are only available once ``deps`` are computed
    (identities with control dependencies): a plan's ordering, never a value change.
    Ragged and sparse values pass unchanged."""
    def gate(value):
        if not isinstance(value, tf.Tensor) or not deps:
            return value
        with tf.control_dependencies(deps):
            return tf.identity(value)
    if isinstance(x, dict):
        return {k: v if k in skip else tf.nest.map_structure(gate, v) for k, v in x.items()}
    return tf.nest.map_structure(gate, x)


def _prepared(plan: StepPlan, carry: StepCarry, i: int, x: Any
              ) -> Optional[List[RoutedLookup]]:
    """Micro-batch ``i``'s lookups of its inputs ``x`` routed and retrieved ahead of its
    forward pass (with ``rows``; the step differentiates them), or None: the forward pass
    routes them. The prefetched ones; without prefetch, with micro-batches, routed and
    retrieved now (their update is coalesced, then split into prior and delayed rows)."""
    if plan.stages is None:
        return None
    if carry.prepared is not None:
        return carry.prepared[i]
    if plan.micro_batches == 1:  # nothing to coalesce or defer: the synchronous step's
        return None
    return plan.stages.retrieve([plan.stages.route_slice(x, i)])[0]


def _prepared_lookups(plan: StepPlan, carry: StepCarry, i: int, x: Any,
                      lookups: Sequence[DistributedGroupLookup]) -> List[RoutedLookup]:
    """Micro-batch ``i``'s prepared lookups (:func:`_prepared`), or [] when the forward
    pass routes them; checks that there is one per group lookup, and that micro-batches
    (whose row gradients are coalesced before one update) have them."""
    mine = _prepared(plan, carry, i, x)
    if mine is None:
        if plan.micro_batches > 1:
            raise ValueError("tf_fusedemb: micro-batches need a plan that prepares each "
                             "micro-batch's lookups: train through "
                             "tf_fusedemb.pipeline.NestedPipeline (or fit(pipeline=...))")
        return []
    if len(mine) != len(lookups):
        raise ValueError(f"tf_fusedemb: the plan prepared {len(mine)} lookups for "
                         f"micro-batch {i}; the model has {len(lookups)} group lookups")
    return list(mine)


def _coalesce(parts, dim):
    """One (keys, grads, init_keys) per group from its micro-batches' records."""
    if not parts:  # the group was not looked up: an empty update
        return tf.zeros([0], tf.int64), tf.zeros([0, dim]), tf.zeros([0], tf.int64)
    if len(parts) == 1:  # keys are unique already (the owner's lookup keys)
        return parts[0]
    return keysets.coalesce(*(tf.concat(list(c), 0) for c in zip(*parts)))
