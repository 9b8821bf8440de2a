"""Keras (tf_keras) layers of tf_fusedemb.

``fuse_model`` (it returns a FusedModel) lives in ``tf_fusedemb.models``; the old path
``tf_fusedemb.layers.fuse_model`` still resolves to it, with a DeprecationWarning.
"""
import importlib
import warnings
from typing import Any

from tf_fusedemb.layers.converter import from_keras_embeddings
from tf_fusedemb.layers.fused_embedding import FusedEmbedding
from tf_fusedemb.layers.lookup_context import LookupContext
from tf_fusedemb.layers.model_embeddings import ModelEmbeddings, fused_embedding_layers, use_context
from tf_fusedemb.layers.routed_lookup import RoutedLookup
from tf_fusedemb.layers.sharded_embedding import ShardedEmbedding

__all__ = ["FusedEmbedding", "LookupContext", "ModelEmbeddings", "RoutedLookup", "ShardedEmbedding",
           "from_keras_embeddings",
           "fused_embedding_layers", "use_context"]


def __getattr__(name: str) -> Any:
    # The one name kept for old code; resolved on access (models/ sits above layers/, so
    # importing it here would be an upward import).
    if name == "fuse_model":
        warnings.warn("tf_fusedemb.layers.fuse_model moved: use tf_fusedemb.models.fuse_model",
                      DeprecationWarning, stacklevel=2)
        return importlib.import_module("tf_fusedemb.models.fuse_model").fuse_model
    raise AttributeError(f"module 'tf_fusedemb.layers' has no attribute {name!r}")
