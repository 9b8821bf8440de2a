"""The dense part of a training step alone, in four forms side by side: float32 or
Keras's ``mixed_bfloat16`` policy, each traced plainly or compiled by XLA.

    python -m tf_fusedemb.benchmarks.dense --json

The step is the lookup benchmark's MLP (``--width`` inputs, 26 x 16 embeddings + 13
dense features by default, -> 256 relu -> 128 relu -> 1 float32 logit): forward, binary
cross-entropy and the gradients of every weight, on one ``--batch-size`` batch, in one
process. The forms run interleaved in shuffled rounds (``timing.time_side_by_side``), so
the ratios are side by side. What it answers: whether bf16 matmuls (AVX-512 BF16, AMX
where the CPU has it, through oneDNN) and XLA pay for this MLP on this CPU; the
embedding ops cannot be compiled by XLA (custom ops and collectives), so only the dense
part could be.
"""
import argparse
import sys
from typing import Any, Callable, Dict

from tf_fusedemb import quiet

quiet.install()  # a command: quiet TensorFlow before it loads

import tensorflow as tf  # noqa: E402
import tf_keras  # noqa: E402

from tf_fusedemb.benchmarks.timing import emit, ratio, time_side_by_side  # noqa: E402

POLICIES = ("float32", "mixed_bfloat16")
HIDDEN = (256, 128)


def dense_step(policy: str, jit: bool, x: tf.Tensor, y: tf.Tensor) -> Callable[[], Any]:
    """A zero-argument callable: one forward + backward of the MLP under ``policy``,
    traced by ``tf.function`` (with XLA when ``jit``); returns once the gradients are
    computed. x: float32[B, width], y: float32[B, 1]."""
    layers = [tf_keras.layers.Dense(u, activation="relu", dtype=policy) for u in HIDDEN]
    layers.append(tf_keras.layers.Dense(1, dtype="float32"))  # the logit stays float32
    model = tf_keras.Sequential(layers)
    model.build((None, x.shape[1]))
    loss = tf_keras.losses.BinaryCrossentropy(from_logits=True)

    @tf.function(jit_compile=jit)
    def step():
        with tf.GradientTape() as tape:
            value = loss(y, model(x))
        return tape.gradient(value, model.trainable_variables)
    return lambda: [g.numpy() for g in step()]


def run(batch_size: int, width: int, repeats: int) -> Dict[str, Any]:
    """The benchmark's result dict (see the module doc)."""
    x = tf.random.stateless_normal([batch_size, width], seed=[0, 1])
    y = tf.cast(tf.random.stateless_uniform([batch_size, 1], seed=[0, 2]) < 0.3, tf.float32)
    variants = {f"{p}{'_xla' if jit else ''}": dense_step(p, jit, x, y)
                for p in POLICIES for jit in (False, True)}
    times = time_side_by_side(variants, repeats)
    return {"benchmark": "dense", "batch_size": batch_size, "width": width,
            "hidden": list(HIDDEN), "repeats": repeats, "tf_version": tf.__version__,
            "variants": times,
            "bf16_speedup": ratio(times["float32"], times["mixed_bfloat16"]),
            "xla_speedup_float32": ratio(times["float32"], times["float32_xla"]),
            "xla_speedup_bf16": ratio(times["mixed_bfloat16"], times["mixed_bfloat16_xla"])}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="dense MLP step: float32/bf16, with/without XLA")
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--width", type=int, default=26 * 16 + 13)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    if min(args.batch_size, args.width, args.repeats) < 1:
        parser.error("--batch-size, --width and --repeats must be >= 1")
    emit(run(args.batch_size, args.width, args.repeats), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
