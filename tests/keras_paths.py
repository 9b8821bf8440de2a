"""Every Keras path a user takes with FusedEmbedding, each next to its reference: the same
model written with ordinary ``Embedding`` layers (tf_keras or Keras 3) and trained the
ordinary way. References are built unseeded, as users build them; the fused model starts
from the reference's initial weights. Module-level functions travel to the ranks of
``DistributedTestCase.run_ranks``."""
import numpy as np
import tensorflow as tf
import tf_keras

from tf_fusedemb.specs import FeatureSpec, OptimizerSpec, TableSpec

FEATURES = ("a", "b", "c")
VOCAB, DIM, BATCH, STEPS = 40, 4, 16, 4
LR = {"sgd": 0.5, "adagrad": 0.3, "ftrl": 0.3}


def data(n=BATCH * STEPS, seed=0):
    """(x {feature: int64[n]}, y float32[n]): skewed IDs, labels from two features."""
    rng = np.random.default_rng(seed)
    x = {f: (rng.zipf(1.3, n).clip(1, VOCAB) - 1).astype(np.int64) for f in FEATURES}
    y = ((x["a"] % 3 == 0) ^ (x["b"] % 4 == 1)).astype(np.float32)
    return x, y


def zero_tables(ref, embeds):
    """Every table of the functional reference at zero, as FTRL tables usually start (and
    the hidden bias at 0.1, so that rows of zeros still get a gradient through the relu)."""
    for emb in embeds.values():
        emb.set_weights([np.zeros_like(emb.get_weights()[0])])
    kernel, bias = ref.get_layer("hidden").get_weights()
    ref.get_layer("hidden").set_weights([kernel, np.full_like(bias, 0.1)])


def data_unique_per_batch(batch=BATCH):
    """Like ``data``, but no ID repeats within a batch of ``batch`` (<= VOCAB) rows."""
    rng = np.random.default_rng(1)
    x = {f: np.concatenate([rng.permutation(VOCAB)[:batch]
                            for _ in range(BATCH * STEPS // batch)]).astype(np.int64)
         for f in FEATURES}
    return x, ((x["a"] % 3 == 0) ^ (x["b"] % 4 == 1)).astype(np.float32)


def keras_optimizer(k, name):
    """The reference's Keras optimizer for rows and dense alike (tf_keras: the legacy Ftrl,
    whose sparse update touches only the rows in the gradient, like ours)."""
    lr = LR[name]
    if name == "ftrl":
        return (k.optimizers.legacy.Ftrl if k is tf_keras else k.optimizers.Ftrl)(lr)
    return {"sgd": k.optimizers.SGD, "adagrad": k.optimizers.Adagrad}[name](lr)


def specs(name):
    optimizer = {"sgd": OptimizerSpec.sgd, "adagrad": OptimizerSpec.adagrad,
                 "ftrl": OptimizerSpec.ftrl}[name](LR[name])
    return [FeatureSpec(f, TableSpec(f"t_{f}", DIM, optimizer, vocabulary_size=VOCAB))
            for f in FEATURES]


def fused_layer_class(k):
    if k is tf_keras:
        from tf_fusedemb.layers import FusedEmbedding  # pylint: disable=import-outside-toplevel
    else:
        from tf_fusedemb.keras3 import FusedEmbedding  # pylint: disable=import-outside-toplevel
    return FusedEmbedding


def embeddings(k, fused, optimizer, inputs, policy=None):
    """(one [B, dim] vector per feature of ``inputs``, the FusedEmbedding layer or the
    {feature: Embedding} of the reference); ``policy``: the layers' Keras dtype policy."""
    if fused:
        embed = fused_layer_class(k)(specs(optimizer), dtype=policy)
        outs = embed(inputs)
        return [outs[f] for f in FEATURES], embed
    embed = {f: k.layers.Embedding(VOCAB, DIM, name=f"emb_{f}", dtype=policy)
             for f in FEATURES}
    return [embed[f](inputs[f]) for f in FEATURES], embed


def functional(k, fused, optimizer="sgd", policy=None):
    """(model, {feature: Embedding} or the FusedEmbedding layer): inputs -> embeddings ->
    Dense(8, relu) -> Dense(1) logit, a functional ``k.Model``. ``policy`` (e.g.
    "mixed_bfloat16"): the dtype policy of every layer but the logit, which stays float32
    (Keras's mixed-precision guide: a float32 output for a float32 loss)."""
    inputs = {f: k.Input((), dtype="int64", name=f) for f in FEATURES}
    vectors, embed = embeddings(k, fused, optimizer, inputs, policy)
    h = k.layers.Dense(8, activation="relu", name="hidden", dtype=policy)(
        k.layers.Concatenate(dtype=policy)(vectors))
    logit = k.layers.Dense(1, name="logit", dtype="float32" if policy else None)(h)
    return k.Model(inputs, logit), embed


def subclassed_class(k, base=None, compiled_call=False):
    """A subclassed ranking model (TensorFlow Recommenders style) on ``base`` (default
    ``k.Model``); ``compiled_call``: its ``call`` decorated with ``tf.function``, as the
    TFRA MovieLens demo writes it."""
    class Ranker(base or k.Model):
        def __init__(self, fused, optimizer="sgd"):
            super().__init__()
            self.fused = fused
            if fused:
                self.embed = fused_layer_class(k)(specs(optimizer))
            else:
                self.embeds = {f: k.layers.Embedding(VOCAB, DIM, name=f"emb_{f}")
                               for f in FEATURES}
            self.hidden = k.layers.Dense(8, activation="relu", name="hidden")
            self.logit = k.layers.Dense(1, name="logit")

        def call(self, x, training=None):
            if self.fused:
                outs = self.embed(x, training=training)
                vectors = [outs[f] for f in FEATURES]
            else:
                vectors = [self.embeds[f](x[f]) for f in FEATURES]
            return self.logit(self.hidden(tf.concat(vectors, 1)))

        def embedding(self):
            return self.embed if self.fused else self.embeds
    if compiled_call:
        Ranker.call = tf.function(Ranker.call)
    return Ranker


def initial_weights(model, embed):
    """{"hidden": [...], "logit": [...], "tables": {feature: float32[V, dim]}} of a built
    reference model."""
    layers = {l.name: l for l in model.layers}
    return {"hidden": layers["hidden"].get_weights(), "logit": layers["logit"].get_weights(),
            "tables": {f: e.get_weights()[0] for f, e in embed.items()}}


def load_weights(model, layer, weights):
    """Puts a reference's initial weights into a fused model (a collective on ranks)."""
    layers = {l.name: l for l in model.layers}
    for name in ("hidden", "logit"):
        layers[name].set_weights(weights[name])
    layer.set_embedding_weights(weights["tables"])


def build(model, x):
    """Creates a subclassed model's variables with one inference call."""
    model({f: v[:2] for f, v in x.items()}, training=False)
    return model


def fused_tables(layer, prefix="t_"):
    """{feature: float32[V, dim]} of this rank's stored rows (zeros where another rank
    owns the row) and {feature: bool[V]} which rows are this rank's; the tables are named
    ``prefix + feature``."""
    tables, owned = {}, {}
    for group in layer.groups:
        rows = group.store.stored_rows()
        for t, spec in enumerate(group.group.tables):
            mine = rows.tables == t
            feature = spec.name[len(prefix):]
            tables[feature] = np.zeros((VOCAB, DIM), np.float32)
            tables[feature][rows.ids[mine]] = rows.values[mine]
            owned[feature] = np.zeros(VOCAB, bool)
            owned[feature][rows.ids[mine]] = True
    return tables, owned


class BatchLosses:
    """A Keras callback (either Keras) recording every training batch's ``loss`` log."""

    def __new__(cls, k, losses=None):
        class Recorder(k.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.losses = [] if losses is None else losses

            def on_train_batch_end(self, batch, logs=None):
                self.losses.append(float(logs["loss"]))
        return Recorder()


def fit(k, model, optimizer, x, y, batch_size, epochs=2, losses=None):
    """compile + fit (per-batch losses, appended to ``losses`` as they come) + predict,
    the ordinary way."""
    model.compile(optimizer=optimizer, loss=k.losses.BinaryCrossentropy(from_logits=True))
    losses = BatchLosses(k, losses)
    model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0,
              callbacks=[losses])
    return {"losses": losses.losses,
            "predictions": model.predict(x, batch_size=batch_size, verbose=0).reshape(-1)}


def custom_loop(k, model, optimizer, x, y, batch_size, epochs=2, losses=None,
                dense_gradients=False):
    """A user's own loop: tf.GradientTape in a tf.function, the Keras optimizer applied to
    ``model.trainable_variables``; per-step losses (appended to ``losses`` as they come)
    and predictions. ``dense_gradients``: an Embedding's sparse gradient (IndexedSlices,
    one slice per occurrence of an ID) made dense first, so the optimizer applies its
    dense update (its sum per row)."""
    loss_fn = k.losses.BinaryCrossentropy(from_logits=True)

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb[:, None], model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        if dense_gradients:
            grads = [tf.convert_to_tensor(g) for g in grads]
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    losses = [] if losses is None else losses
    n = len(y)
    for _ in range(epochs):
        for lo in range(0, n, batch_size):
            losses.append(float(step({f: v[lo:lo + batch_size] for f, v in x.items()},
                                     y[lo:lo + batch_size])))
    return {"losses": losses,
            "predictions": model.predict(x, batch_size=batch_size, verbose=0).reshape(-1)}


# ---- the ranks' side of the 2-rank tests (run_ranks)
def rank_slices(x, y, rank, size, local):
    """This rank's share of every global batch of ``size * local`` rows."""
    idx = np.concatenate([np.arange(lo + rank * local, lo + (rank + 1) * local)
                          for lo in range(0, len(y), size * local)])
    return {f: v[idx] for f, v in x.items()}, y[idx]


def plain_on_ranks(weights, path, optimizer="sgd", wrap=True, policy=None):
    """One rank: the fused functional tf_keras model from ``weights`` (layers under the
    dtype ``policy``), trained on this rank's shares by ``path`` ("fit" or "loop") with
    the wrapped (or, ``wrap=False``, the bare) optimizer. Returns tables, dense weights
    and global predictions, or the error's message and the steps completed before it."""
    from tf_fusedemb.comm import get_communicator  # pylint: disable=import-outside-toplevel
    from tf_fusedemb.training import DistributedOptimizer  # pylint: disable=import-outside-toplevel
    comm = get_communicator()
    x, y = data()
    xr, yr = rank_slices(x, y, comm.rank, comm.size, BATCH)
    model, layer = functional(tf_keras, True, optimizer, policy)
    load_weights(model, layer, weights)
    opt = keras_optimizer(tf_keras, optimizer)
    run = fit if path == "fit" else custom_loop
    done = []
    try:
        out = run(tf_keras, model, DistributedOptimizer(opt) if wrap else opt, xr, yr, BATCH,
                  losses=done)
    except tf.errors.InvalidArgumentError as e:
        return {"error": e.message, "steps_done": len(done)}
    tables, owned = fused_tables(layer)
    return {"tables": tables, "owned": owned, "losses": out["losses"],
            "dense": [v.numpy() for v in model.trainable_variables],
            "predictions": model.predict(x, batch_size=BATCH, verbose=0).reshape(-1)}


def multi_output(fused, optimizer="sgd", model_class=None):
    """A two-headed tf_keras model (click logit, rating regression) with dict outputs."""
    inputs = {f: tf_keras.Input((), dtype="int64", name=f) for f in FEATURES}
    vectors, embed = embeddings(tf_keras, fused, optimizer, inputs)
    h = tf_keras.layers.Dense(8, activation="relu", name="hidden")(
        tf_keras.layers.Concatenate()(vectors))
    outputs = {"click": tf_keras.layers.Dense(1, name="click")(h),
               "rating": tf_keras.layers.Dense(1, name="rating")(h)}
    return (model_class or tf_keras.Model)(inputs, outputs), embed


def fit_multi_output(model, optimizer, x, y, batch_size=BATCH):
    """compile with per-output losses and loss weights, fit on a dict of labels."""
    model.compile(optimizer=optimizer,
                  loss={"click": tf_keras.losses.BinaryCrossentropy(from_logits=True),
                        "rating": "mse"}, loss_weights={"click": 1.0, "rating": 0.5})
    labels = {"click": y, "rating": (y * 3 + 1).astype(np.float32)}
    history = model.fit(x, labels, batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
    predictions = model.predict(x, batch_size=BATCH, verbose=0)
    return history.history, predictions


def keras3_on_ranks(weights, wrap=True, optimizer="sgd", unique=False):
    """One rank: the fused functional Keras 3 model from ``weights``, fit with ``optimizer``
    on this rank's shares of ``data()`` (``unique``: of ``data_unique_per_batch`` for the
    global batch) with DistributedOptimizer (``wrap=False``: the bare optimizer); tables,
    dense weights, global predictions, or the error's message and the steps before it."""
    import keras  # pylint: disable=import-outside-toplevel  # Keras 3: this rank's choice
    from tf_fusedemb.comm import get_communicator  # pylint: disable=import-outside-toplevel
    from tf_fusedemb.keras3 import DistributedOptimizer  # pylint: disable=import-outside-toplevel
    comm = get_communicator()
    x, y = data_unique_per_batch(comm.size * BATCH) if unique else data()
    xr, yr = rank_slices(x, y, comm.rank, comm.size, BATCH)
    model, layer = functional(keras, True, optimizer)
    load_weights(model, layer, weights)
    opt, done = keras_optimizer(keras, optimizer), []
    try:
        out = fit(keras, model, DistributedOptimizer(opt) if wrap else opt, xr, yr, BATCH,
                  losses=done)
    except tf.errors.InvalidArgumentError as e:
        return {"error": e.message, "steps_done": len(done)}
    tables, owned = fused_tables(layer)
    return {"tables": tables, "owned": owned, "losses": out["losses"],
            "dense": [v.numpy() for v in model.trainable_variables],
            "predictions": model.predict(x, batch_size=BATCH, verbose=0).reshape(-1)}


class Interrupted(Exception):
    """What ``stop_at``'s callback raises: a crash in the middle of an epoch."""


def stop_at(k, epoch, batch):
    """A ``k.callbacks.Callback`` that raises Interrupted after step ``batch`` (0-based)
    of epoch ``epoch``."""

    class StopAt(k.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.epoch = None

        def on_epoch_begin(self, epoch_now, logs=None):
            self.epoch = epoch_now

        def on_train_batch_end(self, batch_now, logs=None):
            if (self.epoch, batch_now) == (epoch, batch):
                raise Interrupted((epoch, batch))

    return StopAt()


def interrupted_then_resumed(k, optimizer, x, y, first, build_again, checkpoint):
    """``fit(epochs=3)`` of ``first`` (model, layer) with the callback ``checkpoint()``,
    interrupted after step 6 of epoch 1; then ``fit`` again, with a new ``checkpoint()``,
    of the model ``build_again()`` makes (its own initial weights: the restore decides).
    Returns (that model, its layer, the resumed fit's History)."""
    fit = dict(batch_size=BATCH, epochs=3, shuffle=False, verbose=0)
    model, _ = first
    model.compile(optimizer=keras_optimizer(k, optimizer),
                  loss=k.losses.BinaryCrossentropy(from_logits=True))
    try:
        model.fit(x, y, **fit, callbacks=[checkpoint(), stop_at(k, 1, 6)])
        raise AssertionError("fit was not interrupted")
    except Interrupted:
        pass
    model, layer = build_again()
    model.compile(optimizer=keras_optimizer(k, optimizer),
                  loss=k.losses.BinaryCrossentropy(from_logits=True))
    return model, layer, model.fit(x, y, **fit, callbacks=[checkpoint()])


def assert_same_resumed(got, want, fused, ref, x, tol):
    """The resumed fits' Histories ``got``/``want`` and models ``fused`` (model, layer) and
    ``ref`` (model, {feature: Embedding}) agree to ``tol``: resumed epochs and losses,
    predictions and every row."""
    assert got.epoch == want.epoch == [1, 2], (got.epoch, want.epoch)
    np.testing.assert_allclose(got.history["loss"], want.history["loss"], **tol)
    np.testing.assert_allclose(fused[0].predict(x, verbose=0), ref[0].predict(x, verbose=0),
                               **tol)
    tables, _ = fused_tables(fused[1])
    for f, emb in ref[1].items():
        np.testing.assert_allclose(tables[f], emb.get_weights()[0], **tol, err_msg=f)


def resume_like_backup_and_restore(k, optimizer, ours, theirs, tmp_path, tol):
    """Trains a fused model with our checkpoint callback ``ours(directory)`` and the same
    model with ordinary Embedding layers with Keras's ``theirs(directory)`` (its
    BackupAndRestore), each fit interrupted and resumed on a freshly built model
    (``interrupted_then_resumed``, 8 steps per epoch), from the same initial weights; the
    two must end equal (``assert_same_resumed``)."""
    x, y = data(BATCH * 8)
    ref_first = functional(k, False)
    fused_first = functional(k, True, optimizer)
    load_weights(*fused_first, initial_weights(*ref_first))
    fused, layer, got = interrupted_then_resumed(
        k, optimizer, x, y, fused_first, lambda: functional(k, True, optimizer),
        lambda: ours(str(tmp_path / "fused")))
    ref, embeds, want = interrupted_then_resumed(
        k, optimizer, x, y, ref_first, lambda: functional(k, False),
        lambda: theirs(str(tmp_path / "ref")))
    assert_same_resumed(got, want, (fused, layer), (ref, embeds), x, tol)
