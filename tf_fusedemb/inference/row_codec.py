"""How an export stores its rows: float32, bfloat16, or int8 with a per-row scale.

``encode_rows`` runs on the host when the rows are written; ``decode_rows`` runs in the
serving graph (core TensorFlow ops only), so a SavedModel dequantizes its own rows.

int8 is symmetric: ``q = round(x / s)`` in [-127, 127] with ``s = max|x| / 127`` per
row, one float32 scale per row and no offset. An asymmetric code (a scale and an offset
per row, ``(max - min) / 255``) has a bound on its error at most ~0.5% lower, since the
range of a trained row's values is rarely far from symmetric around 0 (the bound is
``max|x| / 254`` against ``(max - min) / 510``), and it costs 4 more bytes per row: at
dim 16 a row would take 24 bytes instead of 20 (64 in float32).
"""
from typing import NamedTuple, Optional

import numpy as np
import tensorflow as tf

ROW_DTYPES = ("float32", "bfloat16", "int8")
INT8_MAX = 127


class EncodedRows(NamedTuple):
    """Rows as an export stores them: ``rows`` [n, dim] in the row dtype, and for int8
    ``scales`` float32[n] (None otherwise)."""
    rows: np.ndarray
    scales: Optional[np.ndarray]


def check_row_dtype(row_dtype: str) -> str:
    """``row_dtype`` itself, or a one-line ValueError naming the allowed ones."""
    if row_dtype not in ROW_DTYPES:
        raise ValueError(f"row_dtype must be one of {ROW_DTYPES}, got {row_dtype!r}")
    return row_dtype


def tf_dtype(row_dtype: str) -> tf.DType:
    """The TF dtype rows of ``row_dtype`` are stored in."""
    return tf.as_dtype(check_row_dtype(row_dtype))


def encode_rows(values: np.ndarray, row_dtype: str) -> EncodedRows:
    """``values`` float32[n, dim] in ``row_dtype`` (bfloat16: rounded to nearest even;
    int8: symmetric per-row scale, see the module docstring)."""
    values = np.asarray(values, np.float32)
    if check_row_dtype(row_dtype) == "float32":
        return EncodedRows(values, None)
    if row_dtype == "bfloat16":
        return EncodedRows(tf.cast(values, tf.bfloat16).numpy(), None)
    scales = (np.abs(values).max(axis=1, initial=0.0) / INT8_MAX).astype(np.float32)
    safe = np.where(scales > 0, scales, np.float32(1))[:, None]  # a zero row stays 0
    q = np.clip(np.rint(values / safe), -INT8_MAX, INT8_MAX).astype(np.int8)
    return EncodedRows(q, scales)


def decode_rows(rows: tf.Tensor, scales: Optional[tf.Tensor]) -> tf.Tensor:
    """float32 rows [..., dim] of stored ``rows`` [..., dim] and, for int8, their
    ``scales`` float32[...] (in the serving graph)."""
    out = tf.cast(rows, tf.float32)
    return out if scales is None else out * scales[..., None]
