"""The tiered benchmark's DLRM workload: the lookup benchmark's model, its largest tables
under a DRAM budget, trained with ``FusedModel.fit`` as a user trains it.

The model is the lookup benchmark's (``lookup_models``): 26 one-hot Criteo features, one
dynamic table each (dim 16, Adagrad), concatenated with the 13 dense features into an MLP
(256, 128, 1). The batches are its synthetic Criteo-like rows (``lookup_data``), ``batch``
per step on one rank. The tables of the largest vocabularies (``TIERED``: C3, C12, C21,
which hold most of the rows) get ``fraction`` of their payload as their DRAM budget, the
rest stay in DRAM: the table grows through ``growth`` batches, then the next ``steps + 2``
batches of the stream are timed (``tiered_fit.timed_fit``), their tiered tables' keys
mostly stored already (Zipf popularity), the rest new.
"""
import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from tf_fusedemb.benchmarks.lookup_data import CATEGORICAL, DENSE, make_batches, synthetic_columns
from tf_fusedemb.benchmarks.tiered_fit import (ProcessMemory, as_dataset, budget_bytes,
                                               check_mode, compile_model, fit_batches,
                                               timed_fit)

TIERED = ("C3", "C12", "C21")  # the profile's largest vocabularies (5.8 M, 1.2 M, 0.38 M)
SEED = 0  # of the synthetic rows

Batch = Tuple[Dict[str, np.ndarray], np.ndarray]


def dlrm_batches(batch: int, count: int) -> List[Batch]:
    """``count`` batches of ``batch`` synthetic rows: ({"C1".."C26": int64[batch],
    "dense": float32[batch, 13]}, labels float32[batch, 1])."""
    return make_batches(synthetic_columns(batch, 1, count, SEED), batch, 1, 0, count)


def distinct_keys(batches: Sequence[Batch]) -> Dict[str, int]:
    """{tiered table: distinct keys over ``batches``}: the rows it holds after them."""
    return {c: len(np.unique(np.concatenate([x[c] for x, _ in batches]))) for c in TIERED}


def stored_keys(earlier: Sequence[Batch], timed: Sequence[Batch]) -> int:
    """Keys of the tiered tables, unique per step, that a ``timed`` step finds stored
    (drawn by an earlier batch, of ``earlier`` or of ``timed``): the keys the hit rate
    counts."""
    total = 0
    for c in TIERED:
        seen = set(np.unique(np.concatenate([x[c] for x, _ in earlier])).tolist())
        for x, _ in timed:
            step = np.unique(x[c]).tolist()
            total += sum(1 for k in step if k in seen)
            seen.update(step)
    return total


def budgets(fraction: str, rows: Dict[str, int]) -> Dict[str, Optional[int]]:
    """{tiered table: DRAM budget}: ``fraction`` of its ``rows``' payload, None for "1.0"."""
    return {c: budget_bytes(fraction, n) for c, n in rows.items()}


def build(table_budgets: Dict[str, Optional[int]], spill_dir: str, pipelined: bool) -> Any:
    """(compiled FusedModel, its FusedEmbedding): the lookup benchmark's DLRM, the tables of
    ``table_budgets`` tiered at those budgets."""
    import tensorflow as tf  # in a worker: the launcher loads no TensorFlow # pylint: disable=import-outside-toplevel
    import tf_keras  # in a worker, beside TensorFlow # pylint: disable=import-outside-toplevel
    from tf_fusedemb.benchmarks.lookup_models import HIDDEN, feature_specs  # loads TF # pylint: disable=import-outside-toplevel
    from tf_fusedemb.layers import FusedEmbedding  # loads TF: in a worker only # pylint: disable=import-outside-toplevel
    from tf_fusedemb.models import FusedModel  # loads TF: in a worker only # pylint: disable=import-outside-toplevel
    specs = []
    for f in feature_specs(0.05):
        budget = table_budgets.get(f.name)
        specs.append(f if budget is None else dataclasses.replace(f, table=dataclasses.replace(
            f.table, memory_budget_bytes=budget, spill_dir=spill_dir)))
    layer = FusedEmbedding(specs)
    inputs: Dict[str, Any] = {c: tf_keras.Input([], dtype=tf.int64, name=c) for c in CATEGORICAL}
    inputs["dense"] = tf_keras.Input([len(DENSE)], name="dense_features")
    embs = layer({c: inputs[c] for c in CATEGORICAL})
    h = tf_keras.layers.Concatenate()([embs[c] for c in CATEGORICAL] + [inputs["dense"]])
    for units in HIDDEN:
        h = tf_keras.layers.Dense(units, activation="relu")(h)
    return compile_model(FusedModel(inputs, tf_keras.layers.Dense(1)(h)), pipelined), layer


def dlrm_fit_worker(fraction: str, batch: int, growth: int, steps: int, spill_dir: str,
                    mode: str) -> Dict[str, Any]:
    """Grows the DLRM's tables through ``growth`` batches of ``batch`` rows, its tiered
    tables at ``fraction`` of their payload (see the module doc), then times ``steps``
    more batches in ``mode`` ("fit" or "pipelined")."""
    import tensorflow as tf  # in a worker # pylint: disable=import-outside-toplevel
    tf.config.threading.set_intra_op_parallelism_threads(2)
    check_mode(mode)
    stream = dlrm_batches(batch, 1 + growth + steps + 2)
    warm, grow, timed = stream[:1], stream[1:1 + growth], stream[1 + growth:]
    rows = distinct_keys(stream)
    table_budgets = budgets(fraction, rows)
    model, layer = build(table_budgets, spill_dir, mode == "pipelined")
    fit_batches(model, as_dataset(warm))  # traced, kernels loaded
    stored = stored_keys(warm + grow, timed)
    grow_data, timed_data = as_dataset(grow), as_dataset(timed)
    base = ProcessMemory.now()
    fit_batches(model, grow_data)
    return {"budget_bytes": table_budgets, "tiered_rows": rows,
            **timed_fit(model, layer, timed_data, steps, stored, base, mode)}
