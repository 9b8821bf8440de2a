"""``find_keys``: where each key occurs in another batch's keys, as one op (NestPipe's
"dedicated kernel [that] computes the intersection of compact key sets between
consecutive batches")."""
from typing import Optional, Tuple

import tensorflow as tf

from tf_fusedemb.ops import _loader


def find_keys(keys: tf.Tensor, table_keys: tf.Tensor,
              name: Optional[str] = None) -> Tuple[tf.Tensor, tf.Tensor]:
    """Where each of ``keys`` occurs in ``table_keys``.

    Args:
      keys: int64[k].
      table_keys: int64[v]; of equal entries, the first one's position is given.
      name: optional name of the op.

    Returns:
      found: bool[k]; index: int32[k], the position in ``table_keys`` where found, 0
      elsewhere.

    Raises:
      InvalidArgumentError: an argument is not a vector (the message names it).
    """
    return _loader.raw_op("FindKeys")(tf.convert_to_tensor(keys, tf.int64),
                                      tf.convert_to_tensor(table_keys, tf.int64), name=name)


tf.no_gradient("FusedEmb>FindKeys")
