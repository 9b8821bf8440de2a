"""Small DLRM and sequence models, their rows and their batches, shared by
tests/test_distributed_inference.py (single-host checkpoint + SavedModel reference) and
tests/distributed_inference_worker.py (the mpirun ranks). Everything is a pure function
of the seed, so both processes build the same model and read the same batches.

Batches are uneven (sizes below, including a batch of one sample, fewer than the
ranks), list features have samples with no IDs, and a third of the IDs were never
trained (their rows are the deterministic initial rows).

Kinds: "dlrm" (dynamic tables), "static" (the same DLRM over static-vocabulary tables of
VOCAB rows: each rank must allocate only its own rows) and "sequence". A kind suffixed
"+sparse" is the same model and batches with the list features as tf.SparseTensor."""
import numpy as np
import tensorflow as tf

from tf_fusedemb.specs import FeatureSpec, OptimizerSpec, TableSpec

DIM = 4
TRAINED_IDS = 30      # IDs 0..29 have stored rows; IDs up to VOCAB - 1 appear in batches
VOCAB = 45
BATCH_SIZES = (9, 4, 1, 7)
HISTORY_LEN = 5
KINDS = {
    "dlrm": {"a": "scalar", "b": "scalar", "tags": "list"},
    "static": {"a": "scalar", "b": "scalar", "tags": "list"},
    "sequence": {"user": "scalar", "movie": "scalar", "genres": "list", "history": "list"},
}
DENSE = {"dlrm": ("d0", "d1"), "static": ("d0", "d1"), "sequence": ()}
STATIC_TABLES = 3  # the "static" DLRM's tables, VOCAB rows each


def model_kind(kind):
    """The model of a kind ("sequence+sparse" -> "sequence")."""
    return kind.split("+")[0]


def build_model(kind):
    """The model (variables created, no key recorded)."""
    from tf_fusedemb import models  # pylint: disable=import-outside-toplevel
    opt = OptimizerSpec.adagrad(0.05)
    kind = model_kind(kind)
    if kind in ("dlrm", "static"):
        vocab = VOCAB if kind == "static" else None
        specs = [FeatureSpec("a", TableSpec("a", DIM, opt, vocabulary_size=vocab), "sum"),
                 FeatureSpec("b", TableSpec("b", DIM, opt, vocabulary_size=vocab), "sum"),
                 FeatureSpec("tags", TableSpec("tags", DIM, opt, vocabulary_size=vocab),
                             "mean")]
        model = models.DLRM(specs, list(DENSE[kind]), bottom_mlp=(8, DIM), top_mlp=(8,))
    else:
        from tf_fusedemb.models.sequence import SequenceModel, movielens_feature_specs  # pylint: disable=import-outside-toplevel
        model = SequenceModel(movielens_feature_specs(dim=DIM, history_len=HISTORY_LEN,
                                                      optimizer=opt), mlp=(8,))
    model(tf.nest.map_structure(lambda t: t[:0], batches(kind)[0]))
    return model


def train_rows(model, kind, seed=7):
    """Stores rows for IDs < TRAINED_IDS of all tables but one (that one never trained)."""
    from tf_fusedemb.layers.model_embeddings import fused_embedding_layers  # pylint: disable=import-outside-toplevel
    rng = np.random.default_rng(seed)
    tables = ["user", "movie"] if model_kind(kind) == "sequence" else ["a", "tags"]
    layer = fused_embedding_layers(model)[0]
    layer.set_embedding_weights({t: rng.uniform(-1, 1, (TRAINED_IDS, DIM)) for t in tables})


def batches(kind, seed=3):
    """Global batches: {feature: int64[B] | RaggedTensor int64[B, None] (SparseTensor
    int64[B, L] for a "+sparse" kind), dense: f32[B]}."""
    sparse = kind.endswith("+sparse")
    kind = model_kind(kind)
    rng = np.random.default_rng(seed)
    out = []
    for b in BATCH_SIZES:
        batch = {}
        for name, k in KINDS[kind].items():
            if k == "scalar":
                batch[name] = tf.constant(rng.integers(0, VOCAB, b), tf.int64)
            else:
                top = HISTORY_LEN if name == "history" else 4
                lengths = rng.integers(0, top + 1, b)
                lengths[:1] = 0  # the first sample of every batch has no IDs
                values = rng.integers(0, VOCAB, int(lengths.sum()))
                batch[name] = tf.RaggedTensor.from_row_lengths(
                    tf.constant(values, tf.int64), tf.constant(lengths, tf.int64))
                if sparse:
                    batch[name] = batch[name].to_sparse()
        for name in DENSE[kind]:
            batch[name] = tf.constant(rng.standard_normal(b), tf.float32)
        out.append(batch)
    return out


def serving_inputs(kind, batch):
    """The SavedModel signature's raw inputs of a batch (lists padded + lengths)."""
    kind = model_kind(kind)
    raw = {}
    for name, k in KINDS[kind].items():
        if k == "scalar":
            raw[name] = batch[name]
        else:
            raw[name] = batch[name].to_tensor()
            raw[name + "_length"] = batch[name].row_lengths()
    for name in DENSE[kind]:
        raw[name] = batch[name]
    return raw
