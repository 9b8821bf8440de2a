"""Keras (tf_keras) layers of tf_fusedemb."""
from tf_fusedemb.layers.converter import from_keras_embeddings
from tf_fusedemb.layers.fuse_model import fuse_model
from tf_fusedemb.layers.fused_embedding import FusedEmbedding, fused_embedding_layers
from tf_fusedemb.layers.lookup_context import LookupContext, LookupRecord, use_context

__all__ = ["FusedEmbedding", "LookupContext", "LookupRecord", "from_keras_embeddings", "fuse_model",
           "fused_embedding_layers", "use_context"]
