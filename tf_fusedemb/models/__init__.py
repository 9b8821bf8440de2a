"""Models and the sparse-aware training step of tf_fusedemb."""
from tf_fusedemb.models.callbacks import CommCountersLogger, fused_embedding_layers
from tf_fusedemb.models.checkpoint_callback import ShardedCheckpoint
from tf_fusedemb.models.fuse_model import fuse_model
from tf_fusedemb.models.fused_model import FusedModel
from tf_fusedemb.models.shard_embeddings import shard_embeddings
from tf_fusedemb.models.wrapped_model import WrappedModel
from tf_fusedemb.training.step import train_step
from tf_fusedemb.models.blocks import (CRITEO_CATEGORICAL, CRITEO_DENSE, MLP,
                                       criteo_feature_specs)
from tf_fusedemb.models.dcn import CrossLayer, DCNv2
from tf_fusedemb.models.dlrm import DLRM, DotInteraction
from tf_fusedemb.models.sequence import (LocalActivationUnit, SequenceModel,
                                         movielens_feature_specs)

__all__ = ["CRITEO_CATEGORICAL", "CRITEO_DENSE", "CrossLayer", "DCNv2", "DLRM", "DotInteraction",
           "LocalActivationUnit", "MLP", "SequenceModel", "ShardedCheckpoint", "criteo_feature_specs",
           "movielens_feature_specs",
           "CommCountersLogger", "FusedModel", "fuse_model", "shard_embeddings", "WrappedModel", "fused_embedding_layers", "train_step"]
