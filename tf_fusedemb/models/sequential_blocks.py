"""``Sequential`` blocks of a functional model, opened up so that ``fuse_model`` reaches the
``Embedding`` layers inside them.

TensorFlow Recommenders' models look IDs up in blocks such as
``Sequential([StringLookup(vocabulary), Embedding(n, dim)])``, called on an ``Input``
of a functional model. :func:`open_blocks` rewrites the model's config so that each such
block's layers are called one after another in the model itself, in the block's place:
the first on what the block was called on, each next one on the previous one's output,
and whatever took the block's output takes the last layer's. The model computes the same
thing, and its Embeddings are top-level layers that ``fuse_model`` can fuse.

References to a call's output are written ``[layer name, node index, tensor index, ...]``
in both Kerases' configs (tf_keras's nodes, Keras 3's ``keras_history``);
:func:`map_references` rewrites them.
"""
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

__all__ = ["OpenedConfig", "map_references", "open_blocks"]

# (layer name, node index, tensor index) -> the new reference, or None to keep it.
Rename = Callable[[Tuple[str, int, int]], Optional[Tuple[str, int, int]]]


class OpenedConfig(NamedTuple):
    """A functional model's config with its Embedding-holding Sequential blocks opened.

    Fields:
      config: the functional config (tf_keras's or Keras 3's format).
      layers: {layer name in ``config``: the original model's layer it copies}, the
        opened blocks' layers included, in config order.
      opened: the names of the layers that were inside a block.
    """
    config: Dict[str, Any]
    layers: Dict[str, Any]
    opened: frozenset


def map_references(obj: Any, rename: Rename) -> Any:
    """``obj`` (a config's nodes or outputs) with each reference
    ``[layer, node, tensor, *rest]`` renamed by ``rename`` (kept where it gives None)."""
    if (isinstance(obj, list) and len(obj) in (3, 4) and isinstance(obj[0], str)
            and isinstance(obj[1], int) and isinstance(obj[2], int)):
        new = rename((obj[0], obj[1], obj[2]))
        return [*(new or obj[:3]), *[map_references(o, rename) for o in obj[3:]]]
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_references(o, rename) for o in obj)
    if isinstance(obj, dict):
        return {k: map_references(v, rename) for k, v in obj.items()}
    return obj


def open_blocks(config: Dict[str, Any], model: Any, sequential_class: Any,
                embedding_class: Any, node_on: Callable[[Any, int], Any],
                first_node: Callable[[Any], int]) -> OpenedConfig:
    """Opens every ``sequential_class`` layer of ``model`` (the functional model whose
    ``config`` this is) that holds an ``embedding_class`` layer; ``node_on(layer, j)`` is
    the config node of a call on the output of call ``j`` of ``layer``, and
    ``first_node(block)`` the index by which the config refers to the block's first call
    in the model.

    Raises:
      ValueError: a layer in a block has the name of another layer of the model.
    """
    by_name = {l.name: l for l in model.layers}
    entries: List[Dict[str, Any]] = []
    layers: Dict[str, Any] = {}
    # block name -> (the name of its last layer, the config's index of its first call)
    last_of: Dict[str, Tuple[str, int]] = {}
    for entry in config["layers"]:
        block = by_name[entry["name"]]
        if not (isinstance(block, sequential_class)
                and any(isinstance(l, embedding_class) for l in block.layers)):
            entries.append(entry)
            layers[entry["name"]] = block
            continue
        for inner_entry, inner in _chained(entry, block, node_on):
            entries.append(inner_entry)
            layers[inner.name] = inner
        last_of[block.name] = (block.layers[-1].name, first_node(block))
    opened = frozenset(layers) - {e["name"] for e in config["layers"]}
    _check_names(entries)

    def rename(ref):
        if ref[0] not in last_of:
            return None
        last, first = last_of[ref[0]]
        return (last, ref[1] - first, ref[2])

    entries = [dict(e, inbound_nodes=map_references(e["inbound_nodes"], rename))
               for e in entries]
    return OpenedConfig(dict(config, layers=entries,
                             output_layers=map_references(config["output_layers"], rename)),
                        layers, opened)


def _chained(entry: Dict[str, Any], block: Any, node_on: Callable[[Any, int], Any]):
    """(config entry, layer) of each layer of the block ``block`` (whose model config entry
    is ``entry``), each called, once per call of the block, on the previous one's output."""
    inner = {e["config"]["name"]: e for e in entry["config"]["layers"]}
    calls = len(entry["inbound_nodes"])
    previous = None
    for layer in block.layers:
        nodes = entry["inbound_nodes"] if previous is None else [
            node_on(previous, j) for j in range(calls)]
        yield dict(inner[layer.name], name=layer.name, inbound_nodes=nodes), layer
        previous = layer


def _check_names(entries: List[Dict[str, Any]]) -> None:
    names = [e["name"] for e in entries]
    clash = sorted({n for n in names if names.count(n) > 1})
    if clash:
        raise ValueError(f"fuse_model: the layers {clash} of the model's Sequential blocks "
                         "share names with other layers of the model; give them distinct "
                         "names (name=...)")
