"""tf_fusedemb for Keras 3 (``import keras``, TensorFlow backend): the ``FusedEmbedding``
and ``ShardedEmbedding`` layers, ``fuse_model`` for Keras 3 models, the optimizer wrapper a
multi-rank plain model or custom loop uses, and the ``fit`` checkpoint callback.

    import keras
    from tf_fusedemb.keras3 import FusedEmbedding, DistributedOptimizer, fuse_model
"""
from tf_fusedemb.keras3.checkpoint_callback import ShardedCheckpoint
from tf_fusedemb.keras3.fuse_model import fuse_model
from tf_fusedemb.layers.keras3_embedding import FusedEmbedding, ShardedEmbedding
from tf_fusedemb.training.distributed_optimizer import DistributedOptimizer

__all__ = ["DistributedOptimizer", "FusedEmbedding", "ShardedCheckpoint", "ShardedEmbedding",
           "fuse_model"]
