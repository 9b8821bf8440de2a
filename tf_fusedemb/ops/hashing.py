"""The one hash of tf_fusedemb, mirrored in numpy and pure TF.

The C++ kernels (custom_ops/fusedemb_common.h) decide owners and unified keys with
these exact functions; the mirrors let host code (checkpoint resharding, reports)
and tests compute the same values without the op library.

* ``mix64``: MurmurHash3's fmix64, a bijection on 64-bit words.
* ``owner_rank(id, N) = mix64(uint64(id)) % N``: depends on the ID only.
* ``category_tag(name) = mix64(fnv1a64(utf8(name)))``.
* hashed unified key ``H(c, id) = mix64(uint64(id) ^ tag(c))`` as int64.
* packed unified key ``(c << id_bits) | id`` with ``id_bits = 63 - ceil(log2(M))``.
"""
from typing import Iterable, Optional

import numpy as np
import numpy.typing as npt
import tensorflow as tf  # ops/__init__ imports it anyway: no numpy-only path to keep

_M1 = np.uint64(0xFF51AFD7ED558CCD)
_M2 = np.uint64(0xC4CEB9FE1A85EC53)
_S33 = np.uint64(33)


def mix64(x: npt.ArrayLike) -> np.ndarray:
    """fmix64 of ``x`` (any integer array, reinterpreted as uint64) -> uint64 array."""
    a = np.asarray(x)
    # Signed IDs are reinterpreted as in C++: int64 -> uint64 keeps the bits.
    u = a.astype(np.uint64) if a.dtype == np.uint64 else a.astype(np.int64).view(np.uint64)
    with np.errstate(over="ignore"):
        u = u ^ (u >> _S33)
        u = u * _M1
        u = u ^ (u >> _S33)
        u = u * _M2
        u = u ^ (u >> _S33)
    return u


def owner_rank(ids: npt.ArrayLike, num_ranks: int) -> np.ndarray:
    """Owner rank of each ID: ``mix64(uint64(id)) % num_ranks`` -> int32 array."""
    if num_ranks <= 0:
        raise ValueError(f"num_ranks must be positive, got {num_ranks}")
    return (mix64(ids) % np.uint64(num_ranks)).astype(np.int32)


def category_tag(name: str) -> np.uint64:
    """64-bit tag of a category name: ``mix64(fnv1a64(name.encode()))`` -> np.uint64."""
    h = 0xCBF29CE484222325
    for byte in name.encode("utf-8"):
        h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return mix64(np.array([h], dtype=np.uint64))[0]


def category_tags(names: Iterable[str]) -> np.ndarray:
    """Tags of the category ``names`` as int64[M] (the uint64 bits reinterpreted), the form
    graphs take them in (``tf.constant``; TF has no uint64 XOR on CPU)."""
    return np.array([category_tag(n) for n in names], dtype=np.uint64).view(np.int64)


def hashed_unified_keys(ids: npt.ArrayLike, category_names: Iterable[str]) -> np.ndarray:
    """Hashed unified keys ``mix64(uint64(id) ^ tag(c))`` as int64; ``category_names[i]``
    is the category of ``ids[i]``."""
    return tagged_keys(ids, category_tags(category_names))


def tagged_keys(ids: npt.ArrayLike, tags: npt.ArrayLike) -> np.ndarray:
    """Hashed keys int64[n] ``mix64(uint64(id) ^ tag)`` of ``ids`` int[n] with their
    category ``tags`` uint64[n] (or their int64 bits)."""
    ids = np.asarray(ids).astype(np.int64).view(np.uint64)
    return mix64(ids ^ np.asarray(tags).view(np.uint64)).view(np.int64)


def default_id_bits(num_categories: int) -> int:
    """Bits left for IDs by packed mode: ``63 - ceil(log2(M))``."""
    return 63 - int(num_categories - 1).bit_length()


def packed_unified_keys(ids: npt.ArrayLike, segment_ids: npt.ArrayLike, num_categories: int,
                        id_bits: Optional[int] = None) -> np.ndarray:
    """Exact packed keys ``(segment << id_bits) | id`` as int64 (IDs must fit)."""
    bits = default_id_bits(num_categories) if id_bits is None else id_bits
    ids = np.asarray(ids, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= (1 << bits)):
        raise ValueError(f"packed mode needs IDs in [0, 2^{bits})")
    return (np.asarray(segment_ids, dtype=np.int64) << np.int64(bits)) | ids


def tf_mix64(x: "tf.Tensor") -> "tf.Tensor":
    """Pure-TF fmix64 on an int64/int32 tensor -> uint64 tensor (for reference routes)."""
    x = tf.bitcast(tf.cast(x, tf.int64), tf.uint64)
    m1, m2, s = (tf.constant(int(v), tf.uint64) for v in (_M1, _M2, _S33))
    x = tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, s))
    x = x * m1
    x = tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, s))
    x = x * m2
    return tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, s))


def tf_owner_rank(ids: "tf.Tensor", num_ranks: "tf.Tensor") -> "tf.Tensor":
    """Pure-TF ``owner_rank``: ``mix64(uint64(id)) % num_ranks`` of ``ids`` int64[n] for an
    int64 scalar ``num_ranks`` (a tensor: it may be read from a variable) -> int64[n].
    The 64-bit hash is reduced in two 32-bit halves, since TF has no uint64 modulo on
    CPU: (hi * 2^32 + lo) mod n = ((hi mod n) * (2^32 mod n) + lo) mod n."""
    u = tf_mix64(ids)
    hi = tf.cast(tf.bitwise.right_shift(u, tf.constant(32, tf.uint64)), tf.int64)
    lo = tf.cast(tf.bitwise.bitwise_and(u, tf.constant(0xFFFFFFFF, tf.uint64)), tf.int64)
    n = tf.cast(num_ranks, tf.int64)
    return tf.math.floormod(tf.math.floormod(hi, n) * tf.math.floormod(
        tf.constant(1 << 32, tf.int64), n) + lo, n)
