// Interface of the embedding storage engine's ops (custom_ops/embedding_engine.h): a
// resource per group table and rank, holding one block per key (identity, access
// statistics, row, optimizer slots). Python: tf_fusedemb/ops/embedding_engine.py.
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

#include "shape_fn_util.h"

namespace tensorflow {
namespace fusedemb {

using shape_inference::DimensionHandle;
using shape_inference::InferenceContext;
using shape_inference::ShapeHandle;

namespace {

// Output `index` = [u, dim] where u is the length of keys (input 1), dim the "dim" attr.
Status RowsShape(InferenceContext* c, int index) {
  ShapeHandle keys;
  TF_RETURN_IF_ERROR(InputWithRank(c, 1, 1, "keys", &keys));
  int64_t dim;
  TF_RETURN_IF_ERROR(c->GetAttr("dim", &dim));
  c->set_output(index, c->Matrix(c->Dim(keys, 0), dim));
  return absl::OkStatus();
}

// Output `index` = [u, num_slots, dim].
Status SlotsShape(InferenceContext* c, int index, DimensionHandle u) {
  int64_t dim, num_slots;
  TF_RETURN_IF_ERROR(c->GetAttr("dim", &dim));
  TF_RETURN_IF_ERROR(c->GetAttr("num_slots", &num_slots));
  c->set_output(index, c->MakeShape({u, num_slots, dim}));
  return absl::OkStatus();
}

}  // namespace

REGISTER_OP("FusedEmb>EngineHandle")
    .Output("handle: resource")
    .Attr("dim: int >= 1")
    .Attr("optimizer: string")
    .Attr("learning_rate: float")
    .Attr("initial_accumulator_value: float = 0.1")
    .Attr("beta1: float = 0.9")
    .Attr("beta2: float = 0.999")
    .Attr("epsilon: float = 1e-7")
    .Attr("learning_rate_power: float = -0.5")
    .Attr("l1: float = 0.0")
    .Attr("l2: float = 0.0")
    .Attr("initializer: string")
    .Attr("init_params: list(string)")
    .Attr("num_shards: int = 16")
    .Attr("memory_budget_bytes: int = -1")
    .Attr("spill_path: string = ''")
    .Attr("tables: string = ''")
    .Attr("row_dtype: {'float32', 'bfloat16'} = 'float32'")
    .Attr("container: string = ''")
    .Attr("shared_name: string")
    .SetIsStateful()
    .SetShapeFn(shape_inference::ScalarShape)
    .Doc(R"doc(
The engine of one group table on this rank: created on first use, then looked up by
(container, shared_name); a second handle op with the same name must have the same
configuration.

optimizer: "sgd", "adagrad", "ftrl" or "adam" (lazy); hyper-parameters as in
  tf_fusedemb.storage.optimizers.
initializer: "zeros", "uniform", "normal" or "truncated_normal".
init_params: two float64 numbers as text (Python's repr, read back exactly): (minval,
  maxval - minval) for uniform, (mean, stddev) for the normals, as
  tf_fusedemb.storage.initializers computes them. Text because float attrs are float32
  and eager execution takes no tensor attrs; the initial rows must be bit-equal to
  init_rows.
num_shards: power of two; keys are split by the top bits of mix64(key).
memory_budget_bytes: -1: every block in DRAM. Else the DRAM bytes of blocks and index
  the engine keeps at most (per shard budget / num_shards, keys pinned by a running op
  or a prefetch aside); the other blocks are spilled whole to a file of block slots. A
  training step's update, or a prefetch, fails when the blocks pinned at once (a block
  with a row per key) exceed a budget other than 0.
spill_path: the store's directory, this engine's alone (emptied at creation, removed
  with the engine); required with a budget.
tables: the names of the tables the engine holds, for the SSD tier's errors.
row_dtype: how rows are stored: float32, or bfloat16 (rounded to nearest even on every
  store; slots and the optimizer's math stay float32, rows travel as float32).
shared_name: unique per table instance.
)doc");

REGISTER_OP("FusedEmb>EngineLookup")
    .Input("handle: resource")
    .Input("keys: int64")
    .Input("init_keys: int64")
    .Output("rows: float32")
    .Attr("dim: int >= 1")
    .SetShapeFn([](InferenceContext* c) { return RowsShape(c, 0); })
    .Doc(R"doc(
Rows of keys; a key without a stored row gets its initial row (of its init key) and is
not inserted.

keys: [u] storage keys (duplicates allowed). init_keys: [u] keys seeding initial rows.
rows: [u, dim].
)doc");

REGISTER_OP("FusedEmb>EngineApplyGradients")
    .Input("handle: resource")
    .Input("keys: int64")
    .Input("init_keys: int64")
    .Input("grads: float32")
    .Input("step: int64")
    .Input("min_counts: int64")
    .Output("rows: float32")
    .Attr("dim: int >= 1")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) { return RowsShape(c, 0); })
    .Doc(R"doc(
One optimizer step per key: read row and slots, update, write back in one pass; new
keys are inserted (rows from their init keys, slots at their initial values).

keys: [u] UNIQUE storage keys. init_keys: [u]. grads: [u, dim], summed per key.
step: scalar, the optimizer step (Adam's bias correction).
min_counts: [T] admission per table, or [0] for none: a key without a stored row whose
  statistics are recorded with table t and count < min_counts[t] is not stored (a key
  never recorded is not filtered).
rows: [u, dim], the rows after the step (a key not admitted: its unchanged initial row).
)doc");

REGISTER_OP("FusedEmb>EngineRecord")
    .Input("handle: resource")
    .Input("keys: int64")
    .Input("tables: int32")
    .Input("ids: int64")
    .Input("counts: int64")
    .Input("last_steps: int64")
    .Attr("overwrite_last_step: bool")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc(R"doc(
Access statistics: a key gets a tracked block if it has none, counts are added, its
(table, id) set. last_steps (scalar or [u]) become the last steps of keys not tracked
before, and of every key when overwrite_last_step.

keys: [u] unique. tables: [u] in [0, 65535). ids: [u]. counts: [u] >= 0.
last_steps: in int32 range (the block keeps an int32 last step).
)doc");

REGISTER_OP("FusedEmb>EngineFind")
    .Input("handle: resource")
    .Input("keys: int64")
    .Output("stored: bool")
    .Output("tables: int32")
    .Output("ids: int64")
    .Output("counts: int64")
    .Output("last_steps: int64")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle keys;
      TF_RETURN_IF_ERROR(InputWithRank(c, 1, 1, "keys", &keys));
      for (int i = 0; i < 5; ++i) c->set_output(i, keys);
      return absl::OkStatus();
    })
    .Doc(R"doc(
What the engine holds for keys: stored (a row), tables (-1: statistics not tracked),
ids, counts, last_steps (0 where not tracked). All [u].
)doc");

REGISTER_OP("FusedEmb>EngineGatherRows")
    .Input("handle: resource")
    .Input("keys: int64")
    .Output("values: float32")
    .Output("slots: float32")
    .Attr("dim: int >= 1")
    .Attr("num_slots: int >= 0")
    .SetShapeFn([](InferenceContext* c) {
      TF_RETURN_IF_ERROR(RowsShape(c, 0));
      return SlotsShape(c, 1, c->Dim(c->input(1), 0));
    })
    .Doc(R"doc(
Stored rows and optimizer slots of keys; fails naming a key without a stored row.
values: [u, dim]. slots: [u, num_slots, dim].
)doc");

REGISTER_OP("FusedEmb>EngineWriteRows")
    .Input("handle: resource")
    .Input("keys: int64")
    .Input("values: float32")
    .Input("slots: float32")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc(R"doc(
Stores rows and slots (a restore, a weight import); statistics are left as they are.
keys: [u] unique. values: [u, dim]. slots: [u, num_slots, dim].
)doc");

REGISTER_OP("FusedEmb>EngineRemoveRows")
    .Input("handle: resource")
    .Input("keys: int64")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc(R"doc(
Drops the rows and slots of keys (absent keys ignored); their statistics stay.
)doc");

REGISTER_OP("FusedEmb>EngineForget")
    .Input("handle: resource")
    .Input("keys: int64")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc(R"doc(
Forgets the statistics of keys (count, identity, last step); their rows stay.
)doc");

REGISTER_OP("FusedEmb>EngineExport")
    .Input("handle: resource")
    .Output("keys: int64")
    .Output("stored: bool")
    .Output("tables: int32")
    .Output("ids: int64")
    .Output("counts: int64")
    .Output("last_steps: int64")
    .Output("values: float32")
    .Output("slots: float32")
    .Attr("stored_only: bool")
    .Attr("with_rows: bool")
    .Attr("dim: int >= 1")
    .Attr("num_slots: int >= 0")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      const DimensionHandle k = c->UnknownDim();
      for (int i = 0; i < 6; ++i) c->set_output(i, c->Vector(k));
      int64_t dim;
      TF_RETURN_IF_ERROR(c->GetAttr("dim", &dim));
      c->set_output(6, c->Matrix(c->UnknownDim(), dim));
      return SlotsShape(c, 7, c->UnknownDim());
    })
    .Doc(R"doc(
Every block (stored_only: those with a row), sorted by key: keys, stored, tables (-1 not
tracked), ids, counts, last_steps: [k]; with_rows: values [k, dim] and slots
[k, num_slots, dim] (zeros for a block without a row), else both with 0 rows.
)doc");

REGISTER_OP("FusedEmb>EngineStoredKeys")
    .Input("handle: resource")
    .Output("keys: int64")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Vector(c->UnknownDim()));
      return absl::OkStatus();
    })
    .Doc(R"doc(
The keys of every block with a row (both tiers), sorted: [s]. Reads no row and no field.
)doc");

REGISTER_OP("FusedEmb>EngineSize")
    .Input("handle: resource")
    .Output("stored: int64")
    .Output("tracked: int64")
    .Output("bytes_held: int64")
    .Output("ssd_bytes: int64")
    .Output("ssd_io: int64")
    .Output("ssd_index_bytes: int64")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      for (int i = 0; i < 4; ++i) c->set_output(i, c->Scalar());
      c->set_output(4, c->Vector(4));
      c->set_output(5, c->Scalar());
      return absl::OkStatus();
    })
    .Doc(R"doc(
stored: keys with a row. tracked: keys with statistics (both counted in DRAM and on SSD).
bytes_held: the DRAM bytes the engine holds (arena chunks and hash index backing arrays).
ssd_bytes: the bytes of the blocks in the SSD tier (0 without one).
ssd_io: [4] since creation: blocks read from the SSD tier, their bytes, blocks spilled
  to it, their bytes.
ssd_index_bytes: the DRAM bytes of the SSD tier's index of its keys (0 without one).
)doc");

REGISTER_OP("FusedEmb>EnginePin")
    .Input("handle: resource")
    .Input("keys: int64")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc(R"doc(
Reads the blocks of keys from the SSD tier into DRAM and pins them there until as many
EngineUnpin calls of the keys have run (a prefetch of the next batch). A no-op without
an SSD tier. keys: [u] (duplicates pin twice).
)doc");

REGISTER_OP("FusedEmb>EnginePrefetch")
    .Input("handle: resource")
    .Input("keys: int64")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc(R"doc(
A prefetch of the next batch's keys ([u]): pins them in DRAM (read from the SSD tier
now) and releases the pins of the batch prefetched two calls before (the batch whose
prior and delayed updates have both run by then). A no-op without an SSD tier.
)doc");

REGISTER_OP("FusedEmb>EngineUnpin")
    .Input("handle: resource")
    .Input("keys: int64")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc(R"doc(
Releases EnginePin's pins of keys ([u], the same keys), then spills blocks over the
memory budget. A no-op without an SSD tier.
)doc");

REGISTER_OP("FusedEmb>EngineWriteCheckpoint")
    .Input("handle: resource")
    .Input("directory: string")
    .Input("changes_for: string")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc(R"doc(
Writes every block of the engine (rows, slots and statistics; both tiers) to `directory`,
which must not exist (its parent must): for a tiered engine the SSD tier's RocksDB
checkpoint (its files hard-linked) with the DRAM tier's blocks written over it; for an
engine without an SSD tier a new RocksDB database of its blocks. The blocks are not
changed. changes_for: who writes the deltas on this checkpoint (e.g. a checkpoint
manager's id): from here on the engine records the keys whose blocks change, for
EngineWriteDelta by that owner; "" stops recording.
)doc");

REGISTER_OP("FusedEmb>EngineRecordsChangesFor")
    .Input("handle: resource")
    .Input("owner: string")
    .Output("records: bool")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Scalar());
      return absl::OkStatus();
    })
    .Doc(R"doc(
Whether the engine records changes for `owner`: its last checkpoint write (full or delta)
was that owner's, so EngineWriteDelta by `owner` follows it.
)doc");

REGISTER_OP("FusedEmb>EngineWriteDelta")
    .Input("handle: resource")
    .Input("directory: string")
    .Input("changes_for: string")
    .Output("counts: int64")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Vector(2));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Writes to `directory` (which must not exist; its parent must), in EngineWriteCheckpoint's
format, the blocks of the keys changed since the last EngineWriteCheckpoint or
EngineWriteDelta by `changes_for`, and for each such key without a block any more a
deletion (an empty value); then records changes afresh. counts: [blocks, deletions].
Fails unless the engine records changes for `changes_for`.
)doc");

REGISTER_OP("FusedEmb>EngineReadCheckpoint")
    .Input("handle: resource")
    .Input("directories: string")
    .Input("rank: int32")
    .Input("num_ranks: int32")
    .Output("restored: int64")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Scalar());
      return absl::OkStatus();
    })
    .Doc(R"doc(
Puts into the engine (tiered or not) the blocks that `rank` of `num_ranks` owns (owner =
Mix64(ID) mod num_ranks) out of every directory EngineWriteCheckpoint wrote (one per saving
rank), in place of the engine's blocks of the same keys; a delta's deletions (empty values,
EngineWriteDelta) erase their keys' blocks on every rank. restored: the blocks put and
deletions applied.
)doc");

}  // namespace fusedemb
}  // namespace tensorflow
