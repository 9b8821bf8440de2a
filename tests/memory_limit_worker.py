"""One process of tests/test_memory_limit.py: a user's FusedModel.fit of one dynamic table
(dim 16, Adagrad), all in DRAM or under a DRAM budget, then its embedding of sampled
trained keys.

    python tests/memory_limit_worker.py OUT.npz --distinct 400000 --steps 12 \\
        --batch 50000 [--budget-bytes 4000000] [--spill-dir DIR]

Writes ``losses`` float64[steps], ``sample_keys`` int64[k], ``sample_rows``
float32[k, 16] and ``memory`` (the group's ``memory()`` as JSON) to OUT.npz. The model is
unseeded: its dense layer is a fixed, frozen sum, so the rows alone decide the losses.
"""
import argparse
import json

from tf_fusedemb import quiet

quiet.install()

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras  # noqa: E402

from tf_fusedemb.layers import FusedEmbedding  # noqa: E402
from tf_fusedemb.models import FusedModel  # noqa: E402
from tf_fusedemb.specs import FeatureSpec, OptimizerSpec, TableSpec  # noqa: E402
from tf_fusedemb.testing.distributed import BatchLosses  # noqa: E402

DIM = 16


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--distinct", type=int, required=True, help="IDs drawn from [0, distinct)")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--budget-bytes", type=int, default=None)
    p.add_argument("--spill-dir", default=None)
    args = p.parse_args()
    table = TableSpec("c", DIM, OptimizerSpec.adagrad(0.1), memory_budget_bytes=args.budget_bytes,
                      spill_dir=args.spill_dir)
    layer = FusedEmbedding([FeatureSpec("c", table)])
    inputs = {"c": tf_keras.Input([], dtype=tf.int64, name="c")}
    rows = layer(inputs)["c"]
    logits = tf_keras.layers.Dense(1, use_bias=False, kernel_initializer="ones",
                                   trainable=False)(rows)
    model = FusedModel(inputs, logits)
    model.compile(optimizer=tf_keras.optimizers.SGD(0.1),
                  loss=tf_keras.losses.BinaryCrossentropy(from_logits=True))
    rng = np.random.default_rng(3)
    n = args.steps * args.batch
    x = {"c": rng.integers(0, args.distinct, n).astype(np.int64)}
    y = (rng.random((n, 1)) < 0.3).astype(np.float32)
    losses = BatchLosses()
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch), epochs=1,
              verbose=0, callbacks=[losses])
    sample = rng.choice(x["c"], 4000)
    embedder = FusedModel(inputs, rows)
    sample_rows = embedder.predict({"c": sample}, batch_size=1000, verbose=0)
    memory = layer.memory()
    np.savez(args.out, losses=np.asarray(losses.losses), sample_keys=sample,
             sample_rows=sample_rows, memory=json.dumps(memory, default=int))


if __name__ == "__main__":
    main()
