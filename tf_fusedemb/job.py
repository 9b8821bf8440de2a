"""The command line's factory of the main job (``train.py``, ``serve.py``): data sources
and models by name.

Every source returns ``(train, eval, feature_kinds, dense_names)``: train and eval are
tf.data datasets of ``(features dict, label float32[B, 1])`` sharded by rank (train
repeats; eval is finite), ``feature_kinds`` says which FusedEmbedding inputs are scalars
or lists (for the serving signature).
"""
import dataclasses
import os
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import tensorflow as tf

from tf_fusedemb import models
from tf_fusedemb.data import avazu, criteo, movielens
from tf_fusedemb.data.criteo import CRITEO_CATEGORICAL, CRITEO_DENSE, dense_log1p
from tf_fusedemb.data.pipeline import array_batches
from tf_fusedemb.data.synthetic import generate_criteo_like
from tf_fusedemb.data.teacher import teacher_labels
from tf_fusedemb.models.blocks import criteo_feature_specs
from tf_fusedemb.models.fused_model import FusedModel
from tf_fusedemb.models.sequence import SequenceModel, movielens_feature_specs
from tf_fusedemb.specs import FeatureSpec, OptimizerSpec

DATASETS = ("synthetic", "criteo", "movielens", "avazu")
MODELS = ("dlrm", "dcn", "sequence")


def _synthetic_frame(num_rows: int, data_seed: int,
                     teacher_seed: int) -> Tuple[Dict[str, np.ndarray], np.ndarray]:
    data = generate_criteo_like(num_rows, seed=data_seed)
    label, _ = teacher_labels(data, seed=teacher_seed)
    feats = {k: data[k] for k in CRITEO_CATEGORICAL}
    feats.update({k: dense_log1p(data[k]) for k in CRITEO_DENSE})
    return feats, label[:, None]


def _from_frame(feats: Mapping[str, np.ndarray], label: np.ndarray, batch: int, rank: int,
                size: int, repeat: bool) -> tf.data.Dataset:
    # Contiguous rank slices of equal length, so every rank makes the same number of steps.
    per_rank = len(label) // size
    lo, hi = rank * per_rank, (rank + 1) * per_rank
    return array_batches(({k: v[lo:hi] for k, v in feats.items()}, label[lo:hi]), batch,
                         repeat=repeat, drop_remainder=repeat)


WIDE_FEATURE = "W"  # the synthetic data's feature of ``wide_ids`` distinct IDs


def with_wide_ids(data: tf.data.Dataset, distinct: int, rank: int, size: int
                  ) -> tf.data.Dataset:
    """``data``'s ``(features, label)`` batches with one more feature, ``WIDE_FEATURE``:
    int64[B], the ID ``s mod distinct`` of the batch's samples' global index ``s`` (batch
    ``t`` of rank ``r`` holds samples ``(t * size + r) * B ..`` of the job, B the batch's
    size). The job's first ``distinct`` samples meet every ID once, each new when met (a
    user base that keeps growing); later ones go round again. The labels do not depend on
    it: it is storage, the table a model holds at the size users have, not signal.

    Raises ValueError unless ``distinct`` > 0.
    """
    if distinct <= 0:
        raise ValueError(f"wide_ids must be a positive number of distinct IDs, got {distinct}")

    def add(step: tf.Tensor, features: Dict[str, tf.Tensor], label: tf.Tensor):
        b = tf.cast(tf.shape(label)[0], tf.int64)
        first = (step * size + rank) * b
        ids = tf.math.floormod(first + tf.range(b, dtype=tf.int64), distinct)
        return {**features, WIDE_FEATURE: ids}, label

    return tf.data.Dataset.zip((tf.data.Dataset.counter(), data)).map(
        lambda step, batch: add(step, *batch)).prefetch(tf.data.AUTOTUNE)


def make_data(name: str, path: Optional[str], batch_size: int, rank: int, size: int,
              rows: int = 200_000, eval_rows: int = 20_000, seed: int = 0,
              wide_ids: Optional[int] = None
              ) -> Tuple[tf.data.Dataset, tf.data.Dataset, Dict[str, str], Sequence[str]]:
    """Train/eval datasets of ``name`` (see module doc), with ``{feature: "scalar" | "list"}``
    and the dense feature names (float32[B] each). ``wide_ids`` (synthetic data only):
    one more feature, ``WIDE_FEATURE``, of that many distinct IDs (``with_wide_ids``)."""
    kinds = {c: "scalar" for c in CRITEO_CATEGORICAL}
    if wide_ids is not None and name != "synthetic":
        raise ValueError(f"wide_ids needs the synthetic data, got --data {name}")
    if name == "synthetic":
        # One teacher (seed) labels both splits; their rows come from different seeds.
        train_frame = _synthetic_frame(rows, seed, seed)
        eval_frame = _synthetic_frame(eval_rows, seed + 10_000, seed)
        train = _from_frame(*train_frame, batch_size, rank, size, True)
        evaluation = _from_frame(*eval_frame, batch_size, rank, size, False)
        if wide_ids is not None:
            train = with_wide_ids(train, wide_ids, rank, size)
            evaluation = with_wide_ids(evaluation, wide_ids, rank, size)
            kinds[WIDE_FEATURE] = "scalar"
        return train, evaluation, kinds, CRITEO_DENSE
    if not path:  # every other source reads files
        raise ValueError(f"--data {name} needs --data-path" if name in DATASETS else
                         f"--data must be one of {DATASETS}, got {name!r}")
    if name == "criteo":
        if path and os.path.isdir(path):  # the Kaggle layout: train.txt, held-out test.txt
            train = criteo.criteo_dataset(os.path.join(path, "train.txt"), batch_size,
                                          num_shards=size, shard_index=rank, repeat=True,
                                          shuffle_buffer=10_000, seed=seed, drop_remainder=True)
            evaluation = criteo.criteo_dataset(os.path.join(path, "test.txt"), batch_size,
                                               num_shards=size, shard_index=rank)
            return train, evaluation, kinds, CRITEO_DENSE
        train, evaluation = criteo.criteo_eval_split(path, batch_size, num_shards=size,
                                                     shard_index=rank, drop_remainder=True)
        return train.repeat(), evaluation, kinds, CRITEO_DENSE
    if name == "movielens":
        train = movielens.movielens_dataset(path, batch_size, num_shards=size, shard_index=rank,
                                            split="train")
        evaluation = movielens.movielens_dataset(path, batch_size, num_shards=size,
                                                 shard_index=rank, split="test")
        return train.repeat(), evaluation, {"user": "scalar", "movie": "scalar",
                                            "genres": "list", "history": "list"}, ()
    if name == "avazu":
        train = avazu.avazu_dataset(path, batch_size, num_shards=size, shard_index=rank)
        evaluation = avazu.avazu_dataset(path.replace("train.csv", "dev.csv"), batch_size,
                                         num_shards=size, shard_index=rank)
        return train.repeat(), evaluation, {c: "scalar" for c in avazu.AVAZU_CATEGORICAL}, ()
    raise ValueError(f"--data must be one of {DATASETS}, got {name!r}")


@dataclasses.dataclass(frozen=True)
class TableStorage:
    """How the job's tables are stored on each rank.

    Fields:
      memory_budget_bytes: None keeps every row in DRAM; else the DRAM bytes of blocks
        the tables keep altogether (split evenly over the distinct tables, whose fused
        group's budget is the sum), the rest on the SSD tier under ``spill_dir``.
      spill_dir: TableSpec.spill_dir of every table (with a budget only).
      row_dtype: TableSpec.row_dtype of every table: "float32" or "bfloat16".
    """
    memory_budget_bytes: Optional[int] = None
    spill_dir: Optional[str] = None
    row_dtype: str = "float32"

    def apply(self, specs: Sequence[FeatureSpec]) -> List[FeatureSpec]:
        """``specs`` with their tables stored this way."""
        tables = sorted({f.table.name for f in specs})
        share = None if self.memory_budget_bytes is None else \
            self.memory_budget_bytes // len(tables)
        return [dataclasses.replace(f, table=dataclasses.replace(
            f.table, memory_budget_bytes=share, spill_dir=self.spill_dir,
            row_dtype=self.row_dtype)) for f in specs]


def make_model(model: str, feature_kinds: Mapping[str, str], dense_names: Sequence[str],
               dim: int = 16, lr: float = 0.05,
               storage: TableStorage = TableStorage()) -> FusedModel:
    """A FusedModel by name over the data's features, its tables stored as ``storage``
    says (default: every row in DRAM, float32)."""
    optimizer = OptimizerSpec.adagrad(lr)
    if model == "sequence":
        return SequenceModel(storage.apply(movielens_feature_specs(dim=dim, optimizer=optimizer)))
    specs = storage.apply(
        criteo_feature_specs(dim=dim, optimizer=optimizer, names=tuple(feature_kinds)))
    if model == "dlrm":
        return models.DLRM(specs, list(dense_names), bottom_mlp=(64, dim), top_mlp=(128, 64))
    if model == "dcn":
        return models.DCNv2(specs, list(dense_names), num_cross_layers=3, deep=(128, 64))
    raise ValueError(f"--model must be one of {MODELS}, got {model!r}")
