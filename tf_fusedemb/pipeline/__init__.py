"""Pipelining: key-centric sample clustering (tf.data), dual-buffer prefetch and
frozen-window micro-batches (NestPipe), vertical sparse scheduling (EmbRace)."""
from tf_fusedemb.pipeline.clustered_dataset import cluster_dataset
from tf_fusedemb.pipeline.clustering import (cluster_permutation, micro_batch_bounds,
                                             unique_keys_per_micro_batch)
from tf_fusedemb.pipeline.auto import AutoPipeline, make_pipeline
from tf_fusedemb.pipeline.nested import NestedPipeline, refuse_policies_when_looking_ahead
from tf_fusedemb.pipeline.options import PipelineOptions

__all__ = ["AutoPipeline", "NestedPipeline", "make_pipeline", "PipelineOptions", "cluster_dataset", "cluster_permutation",
           "micro_batch_bounds", "refuse_policies_when_looking_ahead", "unique_keys_per_micro_batch"]
