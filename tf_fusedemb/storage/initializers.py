"""Deterministic per-key initialisation of embedding rows, in TF and in numpy.

The correctness contract needs a key's first value to depend on the key only: not on
the rank that owns it, the step that first touches it, or the batch it arrives in. So
rows are not drawn from a random stream but computed from the key with the library's
hash (:func:`tf_fusedemb.ops.hashing.mix64`):

    b[k, j] = mix64(uint64(k) ^ mix64(uint64(j) + SALT))          64 random bits

for key ``k`` and column ``j``. From ``b``:

* uniform in [0, 1):  ``u = (b >> 40) * 2^-24`` (the top 24 bits, exact in float32);
* ``uniform(minval, maxval)``: ``minval + (maxval - minval) * u``;
* ``normal(mean, stddev)``: Box-Muller on two 24-bit uniforms of the same ``b``,
  ``u1 = ((b >> 40) + 1) * 2^-24`` in (0, 1] (bits 63..40, so log(u1) is finite) and
  ``u2 = ((b >> 16) & 0xFFFFFF) * 2^-24`` (bits 39..16):
  ``mean + stddev * sqrt(-2 ln u1) * cos(2 pi u2)``;
* ``truncated_normal(mean, stddev)``: like tf.keras, standard normals outside [-2, 2]
  are redrawn; draw ``r`` uses ``b_r = mix64(b_{r-1} + SALT)`` (uint64, wrapping). After
  ``TRUNCATED_DRAWS`` draws (all rejected with probability 0.0455^8 ~ 2e-11) the last
  one is clipped to [-2, 2];
* ``zeros``.

All float math runs in float64 and is cast to float32 once at the end, in both mirrors:
+ - * / and sqrt are correctly rounded in both, so the float32 results are identical;
log and cos may differ by an ulp of float64 between libms, which changes the float32
result only when the value sits on a rounding boundary (about 2^-29 per value).
"""
import numpy as np
import numpy.typing as npt
import tensorflow as tf

from tf_fusedemb.ops import hashing
from tf_fusedemb.specs import InitializerSpec

__all__ = ["SALT", "TRUNCATED_DRAWS", "init_rows", "init_rows_np"]

# Column salt: the splitmix64 increment (2^64 / golden ratio). Any odd constant would do;
# it keeps column j's seed away from the plain key j, so row k column 0 is not mix64(k).
# Changing it changes every initial row: a checkpoint-format decision, fix it once.
SALT = 0x9E3779B97F4A7C15
TRUNCATED_DRAWS = 8  # draws of truncated_normal before clipping
_TWO_PI = 2.0 * np.pi


def _params(spec):
    p = spec.hparams
    if spec.name == "uniform":
        return p["minval"], p["maxval"] - p["minval"]
    if spec.name in ("normal", "truncated_normal"):
        return p["mean"], p["stddev"]
    return 0.0, 0.0


# ------------------------------------------------------------------ numpy mirror
def _column_seeds(dim):
    """uint64[dim]: mix64(uint64(j) + SALT), the per-column seeds (shared by both mirrors)."""
    with np.errstate(over="ignore"):
        return hashing.mix64(np.arange(dim, dtype=np.uint64) + np.uint64(SALT))


def _np_bits(keys, dim):
    """uint64[u, dim]: b[k, j] = mix64(uint64(k) ^ mix64(uint64(j) + SALT))."""
    keys = np.asarray(keys, dtype=np.int64).reshape(-1).view(np.uint64)
    return hashing.mix64(keys[:, None] ^ _column_seeds(dim)[None, :])


def _np_normal(b):
    """float64 standard normal of each 64-bit word (Box-Muller, bits 63..40 and 39..16)."""
    u1 = ((b >> np.uint64(40)) + np.uint64(1)).astype(np.float64) * 2.0 ** -24
    u2 = ((b >> np.uint64(16)) & np.uint64(0xFFFFFF)).astype(np.float64) * 2.0 ** -24
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(_TWO_PI * u2)


def init_rows_np(keys: npt.ArrayLike, dim: int, spec: InitializerSpec) -> np.ndarray:
    """Numpy mirror of :func:`init_rows`, bit-identical.

    Args:
        keys: int64[u] (any int array; flattened), the init keys.
        dim: int, row width.
        spec: InitializerSpec.

    Returns:
        float32[u, dim].
    """
    b = _np_bits(keys, dim)
    loc, scale = _params(spec)
    if spec.name == "zeros":
        return np.zeros(b.shape, np.float32)
    if spec.name == "uniform":
        z = (b >> np.uint64(40)).astype(np.float64) * 2.0 ** -24
    elif spec.name == "normal":
        z = _np_normal(b)
    else:  # truncated_normal
        z = _np_normal(b)
        for _ in range(TRUNCATED_DRAWS - 1):
            with np.errstate(over="ignore"):
                b = hashing.mix64(b + np.uint64(SALT))  # next draw; wraps like uint64 in TF
            z = np.where(np.abs(z) <= 2.0, z, _np_normal(b))
        z = np.clip(z, -2.0, 2.0)
    return (loc + scale * z).astype(np.float32)


# ------------------------------------------------------------------ TensorFlow
def _tf_mix64_u(x):
    # tf_mix64 takes signed ints; bitcast keeps the bits (tf.cast would be a value cast).
    return hashing.tf_mix64(tf.bitcast(x, tf.int64))


def _tf_normal(b):
    hi = tf.bitwise.right_shift(b, tf.constant(40, tf.uint64)) + tf.constant(1, tf.uint64)
    lo = tf.bitwise.bitwise_and(tf.bitwise.right_shift(b, tf.constant(16, tf.uint64)),
                                tf.constant(0xFFFFFF, tf.uint64))
    u1 = tf.cast(hi, tf.float64) * 2.0 ** -24
    u2 = tf.cast(lo, tf.float64) * 2.0 ** -24
    return tf.sqrt(-2.0 * tf.math.log(u1)) * tf.cos(_TWO_PI * u2)


def init_rows(keys: "tf.Tensor", dim: int, spec: InitializerSpec) -> "tf.Tensor":
    """Initial rows of ``keys``, a pure function of each key (graph-safe, any static shape).

    Args:
        keys: int64[u] (int32 accepted), the init keys (unified, plan-independent keys).
        dim: int, row width.
        spec: InitializerSpec.

    Returns:
        float32[u, dim]; row i depends only on keys[i] and equals ``init_rows_np``.
    """
    keys = tf.reshape(tf.cast(keys, tf.int64), [-1])
    if spec.name == "zeros":
        return tf.zeros(tf.stack([tf.size(keys), dim]), tf.float32)
    cols = tf.constant(_column_seeds(dim), tf.uint64)  # [dim], computed once at trace time
    b = _tf_mix64_u(tf.bitwise.bitwise_xor(tf.bitcast(keys, tf.uint64)[:, None], cols[None, :]))
    loc, scale = _params(spec)
    if spec.name == "uniform":
        z = tf.cast(tf.bitwise.right_shift(b, tf.constant(40, tf.uint64)), tf.float64) * 2.0 ** -24
    elif spec.name == "normal":
        z = _tf_normal(b)
    else:  # truncated_normal: same redraw chain as the numpy mirror
        z = _tf_normal(b)
        for _ in range(TRUNCATED_DRAWS - 1):
            b = _tf_mix64_u(b + tf.constant(SALT, tf.uint64))
            z = tf.where(tf.abs(z) <= 2.0, z, _tf_normal(b))
        z = tf.clip_by_value(z, -2.0, 2.0)
    return tf.cast(loc + scale * z, tf.float32)

