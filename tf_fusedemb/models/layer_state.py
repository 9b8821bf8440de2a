"""A converted model's layers take the original layers' state directly, not through a
serialized config: ``fuse_model`` rebuilds a model from a config in which every lookup
layer's vocabulary is the array that layer was built with, as it is
(:func:`with_vocabularies`), then copies each original layer's weights, and the
vocabulary of a lookup layer that was adapted, into its copy (:func:`copy_state`).

A config serialized by Keras does not carry every vocabulary back: a ``StringLookup``
given a numpy array of bytes (what ``np.unique`` of a string column gives) writes it in a
form its own ``from_config`` cannot read, and an adapted one writes no vocabulary at all.
Giving each copy the vocabulary as the original holds it works for all of them, in
tf_keras and Keras 3 alike.
"""
import copy
from typing import Any, Dict, Mapping, Optional

__all__ = ["copy_state", "is_lookup", "with_vocabularies"]


def is_lookup(layer: Any) -> bool:
    """Whether ``layer`` holds a vocabulary it can give and take (``StringLookup``,
    ``IntegerLookup``, ``TextVectorization`` of either Keras)."""
    return callable(getattr(layer, "get_vocabulary", None)) and callable(
        getattr(layer, "set_vocabulary", None))


def with_vocabularies(entry: Mapping[str, Any], layer: Any) -> Dict[str, Any]:
    """The config entry (``{"class_name", "config", ...}``) of ``layer`` with the
    vocabulary (and idf weights) of ``layer``, and of the layers it holds (a nested
    model's, by name), as each was given to the layer: a copy of the array, bytes or str,
    not its serialized form. The entry itself is not changed."""
    config = dict(entry["config"])
    given = _given_vocabulary(layer)
    if given is not None and "vocabulary" in config:
        config.update(vocabulary=copy.copy(given),
                      idf_weights=copy.copy(getattr(layer, "input_idf_weights", None)))
    inner = config.get("layers")
    if isinstance(inner, list) and hasattr(layer, "layers"):
        by_name = {l.name: l for l in layer.layers}
        config["layers"] = [with_vocabularies(e, by_name[e["config"]["name"]])
                            if e.get("config", {}).get("name") in by_name else e
                            for e in inner]
    return dict(entry, config=config)


def copy_state(old: Any, new: Any) -> None:
    """Puts the state of the layer ``old`` into ``new``, the layer of the same class made
    from ``with_vocabularies``' config: every weight; an adapted lookup layer's vocabulary
    (one given at construction is in ``new`` already); the same for the layers of a
    nested model, layer by layer."""
    inner_old, inner_new = getattr(old, "layers", None), getattr(new, "layers", None)
    if isinstance(inner_old, list) and isinstance(inner_new, list):
        if len(inner_old) != len(inner_new):
            raise ValueError(f"fuse_model: the copy of '{old.name}' has {len(inner_new)} "
                             f"layers, the original {len(inner_old)}")
        for o, n in zip(inner_old, inner_new):
            copy_state(o, n)
        return
    if not is_lookup(old):
        new.set_weights(old.get_weights())
    elif _given_vocabulary(old) is None:  # adapted: its vocabulary lives in its table only
        new.set_vocabulary(old.get_vocabulary(include_special_tokens=False),
                           getattr(old, "input_idf_weights", None))


def _given_vocabulary(layer: Any) -> Optional[Any]:
    """The vocabulary array a lookup layer was built with, None where it was adapted (or
    read from a file, which its config names)."""
    if not is_lookup(layer):
        return None
    given = getattr(layer, "input_vocabulary", None)
    return None if isinstance(given, str) else given
