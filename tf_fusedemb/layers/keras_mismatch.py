"""A layer of one Keras called on the symbolic tensors of the other: refused in one line
naming the class to use.

tf_keras and Keras 3 each have their own layer classes (``tf_fusedemb.layers`` and
``tf_fusedemb.keras3``). A tf_keras layer in a Keras 3 functional model (or the other way
round) would fail deep inside the other Keras's call with a message about tensor
conversion; the layer checks its inputs first and names its twin instead.
"""
from typing import Any, NamedTuple, Optional

import tensorflow as tf

__all__ = ["KerasKind", "keras_of", "refuse_other_keras"]


class KerasKind(NamedTuple):
    """Which Keras a layer class belongs to, for its messages (a class attribute of each
    concrete layer class).

    Fields:
      keras: "tf_keras" or "Keras 3".
      path: the class's public import path, e.g. "tf_fusedemb.layers.FusedEmbedding".
      twin: the path of the same layer for the other Keras.
    """
    keras: str
    path: str
    twin: str


def keras_of(value: Any) -> Optional[str]:
    """"tf_keras" or "Keras 3" for a symbolic tensor of that Keras (its KerasTensor,
    RaggedKerasTensor, ...), None for anything else. Known by the class's module, so
    neither Keras is imported to ask."""
    cls = type(value)
    if "KerasTensor" not in cls.__name__:
        return None
    root = cls.__module__.split(".", 1)[0]
    return {"tf_keras": "tf_keras", "keras": "Keras 3"}.get(root)


def refuse_other_keras(layer: Any, kind: KerasKind, inputs: Any) -> None:
    """Raises a one-line TypeError where ``inputs`` (a tensor or a nest of them) hold a
    symbolic tensor of the Keras ``layer`` (of the kind ``kind``) does not belong to."""
    for leaf in tf.nest.flatten(inputs):
        other = keras_of(leaf)
        if other is not None and other != kind.keras:
            raise TypeError(f"{type(layer).__name__} '{layer.name}' is the {kind.keras} layer "
                            f"({kind.path}) and was called on {other} tensors: in a {other} "
                            f"model use {kind.twin}")
